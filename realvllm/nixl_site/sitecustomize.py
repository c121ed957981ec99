"""Loaded by every Python process of a real-vLLM engine this harness starts (its
PYTHONPATH names this directory): gives NIXL's UCX progress thread a delay.

NIXL's Python agent creates its agent with a progress-thread delay of 0
(``nixl_agent.__init__``: ``agent_config.pthrDelay = 0``), and vLLM offers no setting
for it: the UCX backend's progress thread then polls without pause, a core per idle
engine, and contends for the UCX worker's lock with the thread that runs the model.
On a 2-core machine a one-token request took 2 to 38 s. With
``KVFERRY_NIXL_PROGRESS_DELAY_US`` set, the agent is created with that delay instead
(microseconds between progress polls); transfers still progress in the background.
"""

import os

_delay = os.environ.get("KVFERRY_NIXL_PROGRESS_DELAY_US", "")
if _delay.isdigit() and int(_delay) > 0:
    try:
        import nixl_cu12._api as _nixl_api
    except ImportError:  # (no NIXL in this venv: nothing to change)
        _nixl_api = None

    if _nixl_api is not None:

        class _Bindings:
            """NIXL's bindings module, but agents are made with the progress delay."""

            def __init__(self, real: object) -> None:
                self._real = real

            def __getattr__(self, name: str) -> object:
                return getattr(self._real, name)

            def nixlAgent(self, name: str, config: object) -> object:
                config.pthrDelay = int(_delay)  # type: ignore[attr-defined]
                return self._real.nixlAgent(name, config)  # type: ignore[attr-defined]

        _nixl_api.nixlBind = _Bindings(_nixl_api.nixlBind)
