"""Router configuration: where the control plane and the engines are."""

from __future__ import annotations

import dataclasses


# The default --local-prefill-tokens with KV-aware routing: below this many uncached
# tokens a decode engine computing them itself answers sooner than the P/D path does;
# measured on this project's CPU machines by bench/multiturn.py (docs/BENCHMARKS.md,
# "Conditional disaggregation"). Measure it again on other hardware and models.
LOCAL_PREFILL_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class DecodeEngine:
    engine_id: str      # as registered by its sidecar: the id Reserve answers with
    url: str            # its OpenAI server, e.g. http://127.0.0.1:8200


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    controlplane: str
    token: str                              # the tenant's bearer token
    model: str                              # served model name (what clients ask for)
    prefill_urls: tuple[str, ...]
    decode: tuple[DecodeEngine, ...]
    # The prefill engines' ids as their sidecars registered them ("" where not given),
    # parallel to prefill_urls. A prefill engine with an id gets its request before the
    # Reserve answers (the reservation names it; its sidecar hears it by watch).
    prefill_ids: tuple[str, ...] = ()
    tokenizer_dir: str = ""                 # local model dir for counting prompt tokens
    listen_host: str = "127.0.0.1"
    listen_port: int = 8000
    reserve_timeout_s: float = 0.5          # past this, serve without push rather than wait
    deadline_ms: int = 30_000               # reservation lifetime
    # How long an engine may send nothing: before its answer begins (its queue, a prompt
    # computed whole before a non-streamed answer) or between two of a stream's events. Not
    # a bound on an answer's length: a long generation that keeps streaming is never cut.
    upstream_timeout_s: float = 600.0
    body_timeout_s: float = 30.0            # a client's whole request body must arrive within this
    write_timeout_s: float = 30.0           # ... and it must take each streamed write within this
    header_timeout_s: float = 10.0          # a connection must finish a request's headers within this
    keepalive_timeout_s: float = 75.0       # ... and may sit idle between requests this long
    relocate: bool = True                   # decode failover: move a failed decode's reservation (no 2nd prefill)
    max_model_len: int | None = None        # None: asked of the prefill engine (/v1/models)
    max_logprobs: int = 20                  # the engines' --max-logprobs
    # TLS to the control plane, as every client of it takes it (CA; certificate and key for mTLS)
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    # HTTPS on the router's own port (clients then cannot speak plain HTTP to it)
    http_tls_cert: str = ""
    http_tls_key: str = ""
    # KV-aware routing: hash the prompt's blocks as the decode engines do (their block size,
    # --prefix-caching-hash-algo and PYTHONHASHSEED) and send the keys with the Reserve.
    prefix_block_size: int = 0              # 0: off
    prefix_hash: str = "sha256"
    prefix_hash_seed: str = "vllm-none-hash"
    # Conditional disaggregation: a request whose chosen decode engine lacks fewer than this
    # many of its prompt's tokens is served by that engine alone, no prefill engine involved
    # (0: never). The CLI's default with KV-aware routing is LOCAL_PREFILL_TOKENS.
    local_prefill_tokens: int = 0
    # More registries (a fleet split over control planes, each with its own etcd): (address,
    # tenant token) of each beyond ``controlplane``/``token``. Their engines are found in each
    # (no --prefill/--decode) and every request is reserved in one (``kvpush.router.fleet``).
    more_registries: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.more_registries and (self.prefill_urls or self.decode):
            raise ValueError("--prefill and --decode name one registry's engines: with --controlplane given more "
                             "than once the engines are found in each registry")
        addresses = [a for a, _ in self.registry_targets()]
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"--controlplane names the same registry twice: {addresses}")
        for flag, value in (("--reserve-timeout", self.reserve_timeout_s),
                            ("--header-timeout", self.header_timeout_s),
                            ("--keepalive-timeout", self.keepalive_timeout_s),
                            ("--upstream-timeout", self.upstream_timeout_s)):
            if not value > 0:  # (NaN too)
                raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
        if self.local_prefill_tokens < 0:
            raise ValueError("--local-prefill-tokens must not be negative")
        if self.prefix_block_size < 0:
            raise ValueError("--prefix-block-size must not be negative")
        if self.prefix_block_size:
            from kvpush.contract.block_hash import BlockHasher
            BlockHasher(self.prefix_block_size, self.prefix_hash, self.prefix_hash_seed)  # refused now, by name
        if bool(self.http_tls_cert) != bool(self.http_tls_key):
            raise ValueError("--http-tls-cert and --http-tls-key go together")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")

    def registry_targets(self) -> tuple[tuple[str, str], ...]:
        """(control-plane address, tenant token) of each registry, the first ``controlplane``'s."""
        return ((self.controlplane, self.token), *self.more_registries)

    def prefill_id(self, url: str) -> str:
        for i, u in enumerate(self.prefill_urls):
            if u == url and i < len(self.prefill_ids):
                return self.prefill_ids[i]
        return ""

    def decode_url(self, engine_id: str) -> str | None:
        for engine in self.decode:
            if engine.engine_id == engine_id:
                return engine.url
        return None


def parse_decode(specs: list[str]) -> tuple[DecodeEngine, ...]:
    """``ENGINE_ID=URL`` items, as the CLI takes them."""
    out = []
    for spec in specs:
        engine_id, sep, url = spec.partition("=")
        if not sep or not engine_id or not url.startswith("http"):
            raise ValueError(f"--decode expects ENGINE_ID=http://host:port, got {spec!r}")
        out.append(DecodeEngine(engine_id, url.rstrip("/")))
    return tuple(out)


def parse_prefill(specs: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``ENGINE_ID=URL`` or ``URL`` items: (urls, ids), ids "" where not given."""
    urls, ids = [], []
    for spec in specs:
        engine_id, sep, url = spec.partition("=")
        if not sep:
            engine_id, url = "", spec
        if not url.startswith("http") or (sep and not engine_id):
            raise ValueError(f"--prefill expects [ENGINE_ID=]http://host:port, got {spec!r}")
        urls.append(url.rstrip("/"))
        ids.append(engine_id)
    return tuple(urls), tuple(ids)
