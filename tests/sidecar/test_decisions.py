"""Small decisions of the sidecar: engine health and identity, the registration queue, settings. Pure."""

from __future__ import annotations

import argparse
from dataclasses import replace

import grpc
import pytest

from sidecar.drafts import RetentionDraft
from sidecar.engine import EngineInstance, block_size_of, normalize_engine_id
from sidecar.identity import Answer, Identity, IdentityTracker, State, Step, identity_of, started_at_of
from sidecar.metrics import SidecarMetrics
from sidecar.node import advertised_engine_url, advertised_url
from sidecar.retentions import RegistrationQueue, dead_reason, retry_decision
from sidecar.settings import (
    EngineSettings,
    KvEventSettings,
    Settings,
    TapSettings,
    add_arguments,
    from_args,
    rank_endpoint,
)

OK, FAILED, REFUSED = Answer.OK, Answer.FAILED, Answer.REFUSED
ONE, TWO = Identity("start", 1.0), Identity("start", 2.0)


def test_a_stall_is_not_a_restart() -> None:
    """Probes failing then answering with the same process identity: suspended, then the
    same process again (it kept its blocks). A D stalled ~9 s was counted as restarted,
    every retention of it dead while D kept their blocks pinned."""
    t = IdentityTracker(failures_to_down=2)
    assert t.observe(FAILED) is Step.NONE and t.state is State.STARTING  # engine still loading
    assert t.observe(OK, ONE) is Step.UP
    assert t.observe(FAILED) is Step.NONE  # one failed probe is a blip
    assert t.observe(OK, ONE) is Step.NONE
    assert t.observe(FAILED) is Step.NONE and t.observe(FAILED) is Step.SUSPEND
    assert t.observe(FAILED) is Step.NONE
    assert t.observe(OK, ONE) is Step.RESUME and t.state is State.UP


def test_another_process_is_a_restart_whenever_a_probe_sees_it() -> None:
    t = IdentityTracker(failures_to_down=3)
    t.observe(OK, ONE)
    assert t.observe(OK, TWO) is Step.RESTART and t.known == TWO  # faster than the health window
    assert t.observe(REFUSED) is Step.SUSPEND  # nothing listens: at once, not after 3 failures
    assert t.observe(OK, ONE) is Step.RESTART


def test_an_identity_that_cannot_be_read_is_no_confirmation() -> None:
    t = IdentityTracker(failures_to_down=2)
    t.observe(OK, ONE)
    assert t.observe(OK, None) is Step.NONE and t.observe(OK, None) is Step.SUSPEND
    assert t.observe(OK, ONE) is Step.RESUME
    assert t.suspend() and not t.suspend()  # (a signal: kv_disconnect, say)
    assert t.observe(OK, ONE) is Step.RESUME


def test_an_engine_showing_no_identity_is_restarted_after_any_doubt() -> None:
    """Fail safe, as before identities: back after failing is a new process."""
    t = IdentityTracker(failures_to_down=1)
    assert t.observe(OK, None) is Step.UP and t.observe(OK, None) is Step.NONE
    assert t.observe(FAILED) is Step.SUSPEND
    assert t.observe(OK, None) is Step.RESTART
    t.forget()  # (a new epoch on another signal: the next identity is its own)
    assert t.observe(OK, ONE) is Step.UP


def test_the_identity_falls_back_to_the_counters_creation() -> None:
    text = (
        "process_start_time_seconds 1.7e+09\n"
        'vllm:prompt_tokens_created{engine="0"} 1.8e+09\n'
        "vllm:generation_tokens_created 1.75e+09\n"
    )
    assert identity_of(text) == Identity("start", 1.7e9)
    multiprocess = text.split("\n", 1)[1]  # (several API servers: no process collector)
    assert identity_of(multiprocess) == Identity("created", 1.75e9)
    assert identity_of("vllm:prompt_tokens_total 3\n") is None


def test_engine_ids_per_dp_rank_are_one_engine() -> None:
    assert normalize_engine_id("abc_dp3") == "abc" and normalize_engine_id("abc") == "abc"


def test_a_new_engine_id_is_a_restart() -> None:
    instance = EngineInstance(SidecarMetrics())
    restarts: list[int] = []
    instance.on_restart(lambda: restarts.append(instance.epoch))
    instance.set_generation(0, 4)
    assert instance.observe_engine_id("e1_dp0") == 0
    assert instance.observe_engine_id("e1_dp1") == 0 and instance.generation == 4
    assert instance.observe_engine_id(None) == 0
    assert instance.observe_engine_id("e2") == 1 and restarts == [1]
    assert instance.generation is None and not instance.registered.is_set()
    instance.set_generation(0, 9)  # a registration for the old epoch that finished late
    assert instance.generation is None
    assert instance.observe_engine_id("e2") == 1


def test_block_size_from_vllm_metrics() -> None:
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True"} 1.0\n'
    )
    assert block_size_of(text) == 32 and block_size_of("vllm:num_requests_running 0\n") is None


def _draft(name: str, epoch: int = 0, expires_at: float = 1e12) -> RetentionDraft:
    return RetentionDraft("t", name, {}, 32, expires_at, None, "", epoch)


def test_queue_is_capped_and_drops_the_oldest() -> None:
    q = RegistrationQueue(capacity=2)
    assert q.push(_draft("a")) is None and q.push(_draft("b")) is None
    dropped = q.push(_draft("c"))
    assert dropped is not None and dropped.conversation_id == "a"
    retried = q.retry(_draft("b2"), 0.0, 0)  # a retry goes first; the newest yields
    assert retried is not None and (retried[0].conversation_id, retried[1]) == ("c", "overflow")
    got, dead = q.pop(now_wall=0.0, epoch=0)
    assert got is not None and got.conversation_id == "b2" and not dead


def test_a_draft_a_newer_turn_overtook_is_not_sent() -> None:
    """Registered after the newer turn's draft, it would replace that retention (and have
    D free the newer blocks): the conversation's older draft is superseded instead,
    waiting or failed; the newer one waits while the older one is in flight. (Every draft
    ends in `done`, as the sender calls it: registered or dropped; every try in `landed`.)"""
    q = RegistrationQueue(capacity=10)
    q.push(_draft("c"))
    q.push(_draft("other"))
    q.push(_draft("c"))  # the next turn, while the first still waits
    got, dead = q.pop(now_wall=0.0, epoch=0)
    assert [(d.conversation_id, d.seq, why) for d, why in dead] == [("c", 1, "superseded")]
    q.done(dead[0][0])
    assert got is not None and (got.conversation_id, got.seq) == ("other", 2)
    q.landed(got)
    q.done(got)  # (registered)
    second, _ = q.pop(now_wall=0.0, epoch=0)
    assert second is not None and (second.conversation_id, second.seq) == ("c", 3)
    q.push(_draft("c"))  # the turn after, while the second is in flight: it waits for it
    q.push(_draft("other"))
    other, _ = q.pop(now_wall=0.0, epoch=0)
    assert other is not None and other.conversation_id == "other"  # another conversation goes
    q.landed(other)
    q.done(other)
    assert q.pop(now_wall=0.0, epoch=0) == (None, [])
    # The second's try failed: not sent again (a newer one came), and the third may go.
    assert q.retry(second, 0.0, 0) == (second, "superseded")
    q.landed(second)
    q.done(second)
    third, _ = q.pop(now_wall=0.0, epoch=0)
    assert third is not None and third.seq == 4 and not q.superseded(third)
    q.landed(third)
    q.done(third)
    assert q._newest == {} and q._outstanding == {} and not q._flying  # none kept once done
    q.push(_draft("c"))
    own, _ = q.pop(now_wall=0.0, epoch=0)
    assert own is not None and q.retry(own, 0.0, 0) is None  # its own failure: back in line
    q.landed(own)
    # An expired draft is dropped as expired (D freed those blocks: nothing to release),
    # not as superseded.
    again, _ = q.pop(now_wall=0.0, epoch=0)
    assert again is own
    q.landed(own)
    q.done(own)
    q.push(_draft("d", expires_at=5.0))
    q.push(_draft("d"))
    _, dead = q.pop(now_wall=10.0, epoch=0)
    assert [(d.conversation_id, why) for d, why in dead] == [("d", "expired")]


def test_queue_skips_dead_drafts() -> None:
    q = RegistrationQueue(capacity=10)
    q.push(_draft("old-engine", epoch=0))
    q.push(_draft("expired", epoch=1, expires_at=99.0))
    q.push(_draft("fine", epoch=1, expires_at=200.0))
    got, dead = q.pop(now_wall=100.0, epoch=1)
    assert got is not None and got.conversation_id == "fine"
    assert [(d.conversation_id, why) for d, why in dead] == [
        ("old-engine", "restarted"),
        ("expired", "expired"),
    ]
    assert dead_reason(_draft("x", epoch=1), 100.0, 1) is None


def test_retry_decisions() -> None:
    assert (
        retry_decision(grpc.StatusCode.UNAVAILABLE, 99, 5, sent=False) == "requeue"
    )  # not sent: attempts do not count
    assert retry_decision(grpc.StatusCode.DEADLINE_EXCEEDED, 99, 5, sent=False) == "requeue"
    assert retry_decision(grpc.StatusCode.FAILED_PRECONDITION, 2, 5, sent=False) == "retry"
    assert retry_decision(grpc.StatusCode.RESOURCE_EXHAUSTED, 4, 5, sent=False) == "retry"
    assert retry_decision(grpc.StatusCode.RESOURCE_EXHAUSTED, 5, 5, sent=False) == "attempts"  # the fifth
    assert retry_decision(grpc.StatusCode.ABORTED, 99, 5, sent=True) == "requeue"  # (not applied)
    assert retry_decision(grpc.StatusCode.INVALID_ARGUMENT, 1, 5, sent=False) == "failed"
    # The daemon got it, and whether etcd stored it is open: never sent again.
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL):
        assert retry_decision(code, 1, 5, sent=True) == "maybe_stored"
    assert retry_decision(grpc.StatusCode.FAILED_PRECONDITION, 1, 5, sent=True) == "retry"  # (stored nothing)


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_SIDECAR_ROLE", "both")
    monkeypatch.setenv("KVFERRY_SIDECAR_LIVENESS_TTL", "4")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    s = from_args(
        parser.parse_args(
            [
                "--engine-url",
                "http://10.0.0.1:8000/",
                "--daemon",
                "a:1, b:2",
                "--engine-id",
                "d-7",
                "--block-size",
                "32",
            ]
        )
    )
    assert s.engine.url == "http://10.0.0.1:8000" and s.engine.role == "both" and s.engine.block_size == 32
    assert s.daemon.addresses == ("a:1", "b:2") and s.daemon.liveness_ttl_s == 4 and s.node_id == "d-7"
    with pytest.raises(SystemExit):
        parser.parse_args(["--block-size", "many"])
    args = ["--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-events-ranks", "4"]
    assert from_args(parser.parse_args(args)).kv_events.ranks == 4


def test_a_data_parallel_engines_ranks_publish_on_their_own_endpoints() -> None:
    """As vLLM offsets them (ZmqEventPublisher.offset_endpoint_port): port + rank."""
    assert rank_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert rank_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert rank_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert rank_endpoint("", 2) == ""
    k = KvEventSettings(endpoint="tcp://h:5557", replay_endpoint="tcp://h:5657", ranks=2).for_rank(1)
    assert (k.endpoint, k.replay_endpoint) == ("tcp://h:5558", "tcp://h:5658")
    assert KvEventSettings(endpoint="tcp://h:5557").for_rank(1).replay_endpoint == ""


@pytest.mark.parametrize(
    "change",
    [
        {"engine": {"url": "ftp://x"}},
        {"engine": {"role": "router"}},
        {"daemon": {"liveness_ttl_s": 1}},
        {"daemon": {"addresses": ()}},
        {"tap": {"listen": "nowhere"}},
        {"kv_events": {"replay_endpoint": "tcp://x:1"}},
        {"kv_events": {"endpoint": "127.0.0.1:5557"}},
        {"kv_events": {"endpoint": "tcp://h:5557", "ranks": 0}},
        {"kv_events": {"endpoint": "tcp://h:5557", "ranks": 257}},
        {"kv_events": {"endpoint": "tcp://h:65535", "ranks": 2}},  # rank 1 past the last port
        {"kv_events": {"endpoint": "tcp://h:*", "ranks": 2}},  # no port to add a rank to
        {"kv_events": {"endpoint": "ipc:///run/kv", "ranks": 2}},  # (vLLM offsets TCP ports only)
        {"kv_events": {"endpoint": "tcp://h:5557", "replay_endpoint": "tcp://h:5558", "ranks": 2}},
        {"tap": {"advertise_url": "10.0.0.1:8100"}},
        {"tap": {"advertise_engine_url": "off"}},
        {"tap": {"listen": "0.0.0.0:8100"}},  # plaintext beyond loopback, without --insecure
        {"tap": {"max_body_bytes": 1000}},
        {"tap": {"max_bodies_bytes": 1024 * 1024}},  # less than one body
        {"tap": {"head_timeout_s": 0.0}},
        {"security": {"tls_ca": "ca.pem"}},  # TLS files in part
        {"retentions": {"retry_pause_max_s": 0.0}},
    ],
)
def test_invalid_settings_are_refused(change: dict[str, dict[str, object]]) -> None:
    s = Settings()
    ((group, fields),) = change.items()
    with pytest.raises(ValueError):
        replace(s, **{group: replace(getattr(s, group), **fields)}).validate()


def test_the_taps_url_is_its_side_channel_host_and_port_unless_given() -> None:
    def url(host: str, given: str = "") -> str:
        engine = EngineSettings(url="http://127.0.0.1:8000", side_channel_host=host)
        return advertised_url(Settings(engine=engine, tap=TapSettings(advertise_url=given)), 8100)

    assert url("10.0.0.7") == "http://10.0.0.7:8100"
    assert url("fd00::7") == "http://[fd00::7]:8100"  # a pod's IPv6 address, as $(POD_IP) gives it
    assert url("fd00::7", "http://d-0.vllm:8100") == "http://d-0.vllm:8100"


@pytest.mark.parametrize(
    ("engine", "advertised", "http_url", "expected"),
    [
        # The router reaches the engine wherever it reaches the tap...
        ("http://10.0.0.1:8000/", "", "http://10.0.0.1:8100", "http://10.0.0.1:8000"),
        ("http://127.0.0.1:8000", "", "http://127.0.0.1:8100", "http://127.0.0.1:8000"),
        # ...but not an engine on loopback behind a tap other hosts reach.
        ("http://127.0.0.1:8000", "", "http://10.0.0.1:8100", ""),
        ("http://localhost:8000", "", "http://node-7:8100", ""),
        ("http://127.0.0.1:8000", "http://10.0.0.1:8000/", "http://10.0.0.1:8100", "http://10.0.0.1:8000"),
        ("http://10.0.0.1:8000", "none", "http://10.0.0.1:8100", ""),
    ],
)
def test_advertised_engine_url(engine: str, advertised: str, http_url: str, expected: str) -> None:
    prefill = EngineSettings(url=engine, role="prefill")
    s = Settings(engine=prefill, tap=TapSettings(advertise_engine_url=advertised))
    assert advertised_engine_url(s, http_url) == expected
    both = replace(s, engine=replace(prefill, role="both"))
    assert advertised_engine_url(both, http_url) == expected
    # A decode node's requests all go through its tap.
    assert advertised_engine_url(replace(s, engine=replace(prefill, role="decode")), http_url) == ""


def test_the_engines_start_time_from_its_metrics() -> None:
    text = "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.7648e+09\n"
    assert started_at_of(text) == 1.7648e9
    for bad in ("", "process_start_time_seconds NaN\n", "process_start_time_seconds soon\n"):
        assert started_at_of(bad) == 0.0  # unknown: the daemon gives a new generation


def test_the_default_side_channel_host_is_not_a_loopback_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian and Ubuntu map the host name to 127.0.1.1: told to prefill nodes on other
    hosts, every pull failed. The address this host sends from on its default route is
    taken instead; a host with no route keeps its loopback address."""
    import sidecar.settings

    class Probe:
        routed = "10.1.2.3"

        def __init__(self, *_: object) -> None:
            pass

        def __enter__(self) -> Probe:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def connect(self, _: object) -> None:
            if not self.routed:
                raise OSError("Network is unreachable")

        def getsockname(self) -> tuple[str, int]:
            return self.routed, 40000

    import socket
    import types

    names = {"address": "127.0.1.1"}
    stub = types.SimpleNamespace(
        gethostname=lambda: "host",
        gethostbyname=lambda _: names["address"],
        socket=Probe,
        AF_INET=socket.AF_INET,
        SOCK_DGRAM=socket.SOCK_DGRAM,
    )
    monkeypatch.setattr(sidecar.settings, "socket", stub)  # (this module's only, not the process's)
    assert sidecar.settings.default_host() == "10.1.2.3"
    Probe.routed = ""
    assert sidecar.settings.default_host() == "127.0.1.1"
    names["address"] = "10.9.9.9"
    assert sidecar.settings.default_host() == "10.9.9.9"
