"""`lever serve [-c CONFIG] [--host H] [--port P] [--queue N] [--api-key K]...`: the OpenAI-compatible
server (lever.serve) over the configured pipeline, until SIGINT, SIGTERM or SIGHUP: then new requests
get 503 and the admitted ones --grace seconds to finish before they are cancelled; exit 128 + the signal.
Who may call it (keys, Host, Origin) is lever.serve.guard's; connections are bounded by
lever.serve.protocol."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from lever import signals
from lever.cli.common import add_common, add_set, check_sets, float_in, input_text_file, int_in, port
from lever.cli.models import add_models, check_models, config_and_sets
from lever.errors import LeverError
from lever.serve import MAX_CONNECTIONS, TIMEOUT_S
from lever.serve.guard import LOOPBACK_HOSTS, Access

MAX_QUEUE = 1024
GRACE_S = 5.0  # on shutdown, how long the running generation may go on before it is cancelled
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this long (uvicorn's default)
MAX_KEY_FILE_BYTES = 1 << 20
MAX_KEY_CHARS = 256
KEY_ENV = "LEVER_API_KEY"
MAX_ALIAS_CHARS = 256
MAX_SLOTS = 256


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the configured pipeline")
    add_models(s)
    s.add_argument("-a", "--alias", default=None, metavar="NAMES",
                   help="the model's names in the API, comma-separated: its id is the first in alphabetical order "
                        "(/v1/models lists them all; each reply's model; default: the target's file name)")
    s.add_argument("--tags", default="", metavar="TAGS", help="the model's tags in /v1/models (comma-separated)")
    s.add_argument("--host", default="127.0.0.1", help="the addresses to listen on (comma-separated: 127.0.0.1,::1)")
    s.add_argument("--port", type=port, default=8080)
    s.add_argument("--queue", type=int_in(0, MAX_QUEUE), default=8,
                   help="requests that may wait beside the running one; then 429")
    s.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="a key clients must send as 'Authorization: Bearer KEY' (repeat for several): "
                        "1-256 printable ASCII characters, no spaces (HTTP headers carry ASCII)")
    s.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                   help="keys, one per line (# comments), as --api-key; $LEVER_API_KEY adds one more")
    s.add_argument("--allowed-hosts", default="", metavar="NAMES",
                   help="Host names clients may use beside loopback's and the bound address (comma-separated; * any)")
    s.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                   help="web origins whose pages may call the server, e.g. http://localhost:3000 (comma-separated)")
    s.add_argument("--max-connections", type=int_in(1, 65536), default=MAX_CONNECTIONS,
                   help="connections open at once; past it, 503 and closed (with several keys, a key's requests "
                        "under way: half of it)")
    s.add_argument("--cache-ram", type=int_in(0, 1 << 20), default=256, metavar="MIB",
                   help="MiB of other conversations' KV rows kept between requests, per client key (0: none)")
    s.add_argument("--no-grammars", action="store_true",
                   help="no structured output (grammar, json_schema, a required tool call: refused), and none of "
                        "its memory in the plan (the compiler's child, compiled grammars: ~115 MiB on Qwen's "
                        "vocabulary) under --mem: layers get it")
    s.add_argument("-np", "--parallel", type=int_in(1, MAX_SLOTS), default=1, metavar="N",
                   help="N generations at once, each in a slot (llama-server's) of the context's n_ctx / N tokens "
                        "(--ctx-size is all N's); their trees are verified in shared passes of the target, each "
                        "streamed layer read once for all; the memory plan holds N slots' caches")
    s.add_argument("--kv-unified", action="store_true",
                   help="each slot may fill the whole context (the memory plan holds N caches of it)")
    s.add_argument("--slots", dest="slots", action="store_true", default=True,
                   help="serve GET /slots, the slots and the generation running (the default)")
    s.add_argument("--no-slots", dest="slots", action="store_false", help="/slots answers 501")
    s.add_argument("-v", "--verbose", action="store_true",
                   help="every answer carries llama-server's __verbose (its own shape, the prompt as read)")
    s.add_argument("--metrics", action="store_true",
                   help="serve /metrics in Prometheus's format (llama-server's names, prefixed lever:)")
    s.add_argument("--no-page", dest="page", action="store_false",
                   help="serve no live page at / (nor its /live events): generations are not watched")
    s.add_argument("--grace", type=float_in(0, 3600), default=GRACE_S, metavar="S",
                   help="on shutdown, seconds the admitted requests may go on before they are cut")
    s.add_argument("--timeout", type=float_in(0.1, 3600), default=TIMEOUT_S, metavar="S",
                   help="seconds a request's headers, its body, and a chat template's render may each take")
    add_set(s)
    add_common(s)
    s.set_defaults(func=main, check=check_args)
    return s


def check_args(args) -> None:
    """--port and --queue are bounded by their types (lever.cli.common); the rest, before loading."""
    for host in hosts(args.host):
        if not host or any(c.isspace() for c in host):
            raise LeverError(f"--host: not a host name or address: {host!r}")
    check_models(args)
    for flag, value in (("--alias", args.alias), ("--tags", args.tags or None)):
        for name in names_of(value) if value is not None else ():
            if not 0 < len(name) <= MAX_ALIAS_CHARS:
                raise LeverError(f"{flag}: each name 1-{MAX_ALIAS_CHARS} characters, got {len(name)}")
    for k in args.api_key:
        _check_key(k, "--api-key")
    if args.api_key_file is not None:
        input_text_file(args.api_key_file, "--api-key-file", "key file", max_bytes=MAX_KEY_FILE_BYTES)
    check_sets(args)


def hosts(value: str) -> list[str]:
    """--host's addresses (comma-separated), an IPv6 one with or without its brackets."""
    return [h.strip().removeprefix("[").removesuffix("]") for h in value.split(",")]


def names_of(value: str) -> list[str]:
    """--alias's or --tags' names: comma-separated, each once, in alphabetical order (llama-server's)."""
    return sorted({n.strip() for n in value.split(",")})


def settings(args):
    """What the flags tell the routes beside the model (lever.serve.server.Settings)."""
    from lever.serve.server import Settings

    return Settings(aliases=tuple(names_of(args.alias)) if args.alias is not None else (),
                    tags=tuple(names_of(args.tags)) if args.tags else (), n_slots=args.parallel, slots=args.slots,
                    verbose=args.verbose)


def listening(host_list: list[str], port: int) -> list:
    """A socket bound to each address (uvicorn serves them all), or one line saying which could not be."""
    import socket

    out = []
    try:
        for host in host_list:
            try:
                family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
                sock = socket.socket(family, kind, proto)
                out.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
                sock.set_inheritable(True)
            except OSError as e:
                raise LeverError(f"--host {host}: cannot listen on port {port}: {e.strerror or e}") from None
    except LeverError:
        for sock in out:
            sock.close()
        raise
    return out


def _check_key(key: str, where: str) -> str:
    """A key as a client can send it: an Authorization header's value is bytes a server reads as
    Latin-1 (clients differ on how they encode anything past ASCII), so only printable ASCII
    (! to ~) is a key every client sends the same way. Refused in one line naming where it came
    from and why, never the key."""
    if not 1 <= len(key) <= MAX_KEY_CHARS:
        why = "it is empty" if not key else f"it has {len(key)} characters"
    else:
        bad = next((i for i, c in enumerate(key) if not "!" <= c <= "~"), None)
        if bad is None:
            return key
        why = f"character {bad + 1} is {_unfit(key[bad])}"
    raise LeverError(f"{where}: a key is 1-{MAX_KEY_CHARS} printable ASCII characters without spaces; {why}")


def _unfit(c: str) -> str:
    if c == " ":
        return "a space"
    if c == "\ufffd" or "\udc80" <= c <= "\udcff":  # a file's / argv's / environ's bytes that are not UTF-8
        return "a byte that is not UTF-8 (Latin-1?)"
    return f"U+{ord(c):04X}, not printable ASCII"


def access(args) -> Access:
    """The access rules from the flags; keys from --api-key, --api-key-file and $LEVER_API_KEY
    (a key on the command line shows in `ps`; the file and the variable do not)."""
    keys = list(args.api_key)
    if os.environ.get(KEY_ENV):
        keys.append(_check_key(os.environ[KEY_ENV].strip(), f"${KEY_ENV}"))
    if args.api_key_file is not None:
        # lines split as bytes (str.splitlines would also split at \x0b, \x1c, U+2028, ... inside a
        # key); a line in another encoding than UTF-8 decodes to U+FFFD, which no key may hold
        raw = args.api_key_file.read_bytes().removeprefix(b"\xef\xbb\xbf")  # an editor's UTF-8 mark
        for i, line in enumerate(raw.splitlines(), 1):
            line = line.decode("utf-8", errors="replace").strip()
            if line and not line.startswith("#"):
                keys.append(_check_key(line, f"{args.api_key_file}:{i}"))
        if not keys:
            raise LeverError(f"{args.api_key_file}: --api-key-file: no key in it")

    def names(value: str) -> frozenset[str]:
        return frozenset(n.strip().lower().rstrip("/") for n in value.split(",") if n.strip())

    return Access(bound_host=",".join(hosts(args.host)).lower(), api_keys=tuple(keys),
                  allowed_hosts=names(args.allowed_hosts),
                  allowed_origins=names(args.allowed_origins))


def main(args) -> int:
    check_args(args)
    rules = access(args)  # the keys from the file and $LEVER_API_KEY checked before anything is imported or loaded
    try:
        import uvicorn

        from lever.serve import app
        from lever.serve.protocol import protocol_class
    except ImportError as e:
        # by the packages' names: PyPI's `lever` is another project, so `pip install 'lever[serve]'` would
        # bring that one; from Lever's own checkout `pip install -e ".[serve]"` is the same
        raise LeverError(f"lever serve needs starlette and uvicorn ({e.name} is missing): "
                         f"pip install 'starlette>=0.37' 'uvicorn>=0.30'") from None
    from lever.api import load

    llm = _load(args, load)
    server_state = None
    try:
        options = settings(args)
        model_id = options.aliases[0] if options.aliases else Path(llm.config.model.target).stem
        asgi = app(llm, model_id=model_id, queue=args.queue, access=rules, timeout_s=args.timeout,
                   metrics=args.metrics, cache_bytes=args.cache_ram << 20, page=args.page,
                   max_connections=args.max_connections, settings=options)
        server_state = asgi.app.state.server
        http = protocol_class(max_connections=args.max_connections, header_timeout_s=args.timeout)
        server = _server_class()(uvicorn.Config(asgi, host=args.host, port=args.port, log_level="warning",
                                                access_log=False, http=http, timeout_keep_alive=KEEP_ALIVE_S))

        def stop(signum: int) -> None:  # INT, TERM or HUP: stop listening, drain, then cancel
            server.should_exit = True
            server_state.shutdown(args.grace)

        sockets = listening(hosts(args.host), args.port)  # each address, before the line saying it listens
        if llm.structured:
            llm.grammars.start()  # the grammar compiler's child, before the first schema waits for it
        _announce(args, llm, rules, server_state, model_id)
        _say_template(llm)
        if not rules.api_keys and not set(hosts(args.host.lower())) <= LOOPBACK_HOSTS:
            print(f"lever serve: warning: listening on {args.host} without --api-key: anyone who can reach "
                  "this address can use the model", file=sys.stderr, flush=True)
        with signals.on_stop(stop):
            server.run(sockets=sockets)
    finally:
        if server_state is not None:
            server_state.prep.close()
        llm.close()
    if (s := signals.pending()) is not None:
        raise signals.Interrupted(s)  # the command ends as every stopped command does: 128 + n
    return 0


def _announce(args, llm, rules: Access, server_state, model_id: str) -> None:
    """The server's plan checked against the memory it may have, then its one line: where it
    listens, its model, slots, queue, keys and memory plan."""
    # what the RSS stays within: the largest request's plan, what requests hold (their bodies,
    # parsing, queued calls), the kept conversations, the live page (Server.memory_plan)
    plan = {k: v >> 20 for k, v in server_state.memory_plan().items()}
    plan_mib, grammar_mib = sum(plan.values()), llm.memory_plan().grammar_bytes >> 20
    if getattr(args, "mem", None) is not None:
        from lever.backends.flash.config import parse_bytes
        check_plan(plan, parse_bytes(args.mem), cache_ram_mib=args.cache_ram, limit_name=f"--mem {args.mem}")
    else:
        check_plan(plan, llm.config.memory.limit_bytes, cache_ram_mib=args.cache_ram)
    first = hosts(args.host)[0]
    url = f"http://{f'[{first}]' if ':' in first else first}:{args.port}"
    print(f"lever serve: {url}/v1 ({model_id}, {llm.config.pipeline.kind}), "
          f"{args.parallel} slot{'s' * (args.parallel != 1)} of {llm.n_ctx} tokens, queue {args.queue}, "
          f"{len(rules.api_keys) or 'no'} API key{'s' * (len(rules.api_keys) != 1)}, "
          f"memory plan {plan_mib} MiB (a run {plan['run']}, its grammars {grammar_mib} among them + requests "
          f"{plan['requests']} + kept conversations {plan['kept conversations']} + live page {plan['live page']})"
          + (f"; the live page: {url}/" if server_state.page is not None else ""),
          file=sys.stderr, flush=True)


def _say_template(llm) -> None:
    """A GGUF with no chat template chats in ChatML (llama-server's fallback): said once, at the start."""
    if (note := llm.chat_template.note) is not None:
        print(f"lever serve: {note}", file=sys.stderr, flush=True)


def _load(args, load):
    """The pipeline; under --mem, planned within what the server's own parts leave of it (its
    requests, kept conversations, live page), so the whole server keeps to --mem."""
    config, model_sets = config_and_sets(args)
    model_sets += _slot_sets(config, [*model_sets, *args.set], args)
    grammars = not getattr(args, "no_grammars", False)
    if getattr(args, "mem", None) is None:
        return load(config, overrides=[*model_sets, *args.set], grammars=grammars)
    from lever.backends.flash.config import parse_bytes
    from lever.pipelines.watch import LIVE_BYTES
    from lever.serve.pool import POOL_BYTES, server_parts

    mem = parse_bytes(args.mem)
    own = sum(server_parts(cache_bytes=args.cache_ram << 20, live_bytes=LIVE_BYTES if args.page else 0).values())
    where = (f"--mem {args.mem}: {own >> 20} MiB of it go to requests ({POOL_BYTES >> 20}), kept conversations "
             f"(--cache-ram {args.cache_ram}) and the live page")
    if own >= mem:
        raise LeverError(f"{where}, which leaves nothing for the run; give more, or a smaller --cache-ram")
    try:
        return load(config, overrides=[*model_sets, *args.set, f"memory.limit={mem - own}"], grammars=grammars)
    except LeverError as e:
        raise LeverError(f"{where}; the run in the {(mem - own) >> 20} MiB left: {e}") from None


def _slot_sets(config, sets: list[str], args) -> list[str]:
    """--parallel N: N generations at once ([pipeline] parallel), each slot's context the
    context's n_ctx / N tokens, as llama-server divides it (--kv-unified: the whole context
    each); the pipeline is opened with one slot's, and its memory plan holds N."""
    if args.parallel <= 1:
        return []
    if args.kv_unified:
        return [f"pipeline.parallel={args.parallel}"]
    from lever.config import load_config
    from lever.gguf.file import GGUFFile
    from lever.gguf.spec import read_spec

    cfg = load_config(config, sets)
    n_ctx = min(cfg.model.n_ctx, read_spec(GGUFFile(cfg.model.target)).n_ctx_train) // args.parallel
    if n_ctx < 2:
        raise LeverError(f"--parallel {args.parallel}: a slot's context would be {n_ctx} tokens; give fewer slots "
                         "or more --ctx-size (or --kv-unified)")
    return [f"model.n_ctx={n_ctx}", f"pipeline.parallel={args.parallel}"]


def check_plan(plan: dict[str, int], limit_bytes: int | None, *, cache_ram_mib: int,
               limit_name: str = "[memory] limit") -> None:
    """The server's plan (MiB by part) against [memory] limit (--mem) and what the process may
    still take (the machine's memory, or its cgroup's: lever.policy.memory.room_bytes), as
    `lever run` checks its own; one line naming --cache-ram when that is what does not fit."""
    import psutil

    from lever.policy.memory import room_bytes

    total = sum(plan.values()) << 20
    parts = (f"a run's {plan['run']} MiB, {plan['requests']} MiB for requests and the live page's "
             f"{plan['live page']} MiB")
    if limit_bytes is not None and total > limit_bytes:
        raise LeverError(f"--cache-ram: {cache_ram_mib} MiB of kept conversations beside {parts} passes "
                         f"{limit_name} ({limit_bytes >> 20} MiB); give less")
    more = total - psutil.Process().memory_info().rss
    room, whose = room_bytes()
    if more > room:
        raise LeverError(f"--cache-ram: {cache_ram_mib} MiB of kept conversations beside {parts}: the server's "
                         f"plan of {total >> 20} MiB needs {more >> 20} MiB more than it holds now, but {whose} has "
                         f"{room >> 20} MiB available; give less")


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server without its own signal handlers: lever.signals has INT, TERM and
        HUP (uvicorn would take two of them, and re-raise them after its shutdown)."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server
