"""Who may do what: the security contracts every kvferry process shares.

- `roles`: the roles, the caller a request runs as, and the pure table of what each role
  may call (gRPC methods, tenants, nodes);
- `policy`: the operator's policy file (identities, their roles, bearer tokens, and the
  router's API keys), loaded and checked;
- `tls`: TLS files, SSL contexts and gRPC credentials that follow certificate rotation,
  the peer identity of a connection, and the rule that plaintext stays on loopback;
- `audit`: one log line per denial and per allowed administrative action;
- `devca`: a development CA with certificates for every part (`kvferry certs`).

Development mode (no TLS, no policy file; every listener on loopback) trusts every caller
as an admin, so `make run` and `make test` need no certificate step.
"""
