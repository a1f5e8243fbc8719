"""python -m nxdi_voxtral serve [--artifacts DIR | --model DIR] [--host H --port P] ...

Signals: SIGHUP re-reads the source (for --artifacts: where `current` points now) and hot-swaps to it;
--watch S polls the `current` link every S seconds and does the same on a change. SIGTERM / SIGINT: stop
accepting, finish in-flight requests within --grace seconds, stop the rank workers, exit 0.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading

log = logging.getLogger("nxdi_voxtral.serve")


def add_arguments(p) -> None:
    from ..application import MAX_AUDIO_S
    src = p.add_mutually_exclusive_group()
    src.add_argument("--artifacts", help="compiled artifacts: a build dir or the deploy link, e.g. /srv/voxtral/current")
    src.add_argument("--model", help="HF checkpoint dir (uncompiled path); neither: the embedded demo model")
    p.add_argument("--draft", help="draft checkpoint dir (--model / demo only)")
    p.add_argument("--draft-kind", choices=["layers", "dflash", "ngram"], default=None)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (--model / demo; artifacts carry theirs)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--buckets", help="--model / demo: e.g. audio=1,2:kv=512,1024 (artifacts carry theirs)")
    p.add_argument("--backend", default="eager",
                   help="--model / demo: a backend that prepares the graphs at load (eager, inductor, torchneuron; "
                        "artifacts carry theirs)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default="voxtral-mini-3b")
    p.add_argument("--max-upload-mb", type=float, default=25.0, help="request body limit (413 past it)")
    p.add_argument("--max-batch", type=int, default=1,
                   help="most requests decoded together (continuous batching); each needs a KV slot: --model / demo "
                        "load batch buckets up to N, a release must have them (build --buckets ...:batch=1,2,4,8)")
    p.add_argument("--queue-depth", type=int, default=8, help="requests that may wait for the device (503 past it)")
    p.add_argument("--queue-timeout", type=float, default=30.0, help="seconds a request may wait (503 past it)")
    p.add_argument("--max-new-tokens", type=int, default=448,
                   help="cap per request, per window of a long upload (requests may ask for less with "
                        "max_completion_tokens; the KV buckets cap it)")
    p.add_argument("--max-audio-s", type=float, default=MAX_AUDIO_S,
                   help="longest upload (413 past it, measured from the header); one longer than the largest audio "
                        "bucket is cut into windows at quiet points, decoded together in the batch (default 3 h)")
    p.add_argument("--watch", type=float, default=2.0, help="poll the artifacts link every S s (0: SIGHUP only)")
    p.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--log-level", default="info")


def source_from_args(args):
    from .host import Source
    if args.artifacts:
        return Source("artifacts", args.artifacts)  # its buckets, KV slots included, are the release's
    draft, kind, path = args.draft, args.draft_kind, args.model
    if draft is not None and kind is None:
        kind = "layers"
    if path is None:
        from ..synthetic import demo_dirs
        demo = demo_dirs()
        path = str(demo["target"])
        if draft is None and kind in ("layers", "dflash"):
            draft = str(demo[kind])
        print(f"[demo] no --model / --artifacts: synthetic demo weights, transcripts are meaningless ({path})",
              file=sys.stderr)
    from dataclasses import replace
    from ..graphs import batch_sizes_up_to, parse_buckets
    buckets = parse_buckets(args.buckets)
    if buckets.max_batch < args.max_batch:  # a KV slot per sequence of the largest batch
        buckets = replace(buckets, batch_sizes=batch_sizes_up_to(args.max_batch))
    return Source("demo" if args.model is None else "model", path, draft, kind, args.num_speculative_tokens,
                  args.tp, args.dtype, buckets, args.backend)


def serve(args) -> int:
    import uvicorn

    from ..errors import ConfigError
    from .app import UploadGuard, RequestMetrics, create_app
    from .host import Host
    from .metrics import Metrics

    for name, value, low in (("--queue-depth", args.queue_depth, 0), ("--max-new-tokens", args.max_new_tokens, 1),
                             ("--tp", args.tp, 1), ("--max-batch", args.max_batch, 1)):
        if value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")
    if args.queue_timeout <= 0 or args.max_upload_mb <= 0 or args.max_audio_s <= 0 or args.grace < 0 \
            or args.watch < 0:
        raise ConfigError("--queue-timeout, --max-upload-mb and --max-audio-s must be > 0, --grace and --watch >= 0")
    from .. import backends
    if not backends.get(args.backend).from_checkpoint:  # an unknown name is a ConfigError here, before loading
        raise ConfigError(f"--backend {args.backend}: runs from artifacts; build them and serve with --artifacts")
    metrics = Metrics()
    host = Host(source_from_args(args), metrics, args.max_new_tokens, args.max_batch, args.max_audio_s)
    stop = threading.Event()
    server: uvicorn.Server | None = None

    def load_first():
        try:
            host.start()
            log.info("ready: %s version %s on http://%s:%d", host.source.kind, host.live.version.id, args.host,
                     args.port)
        except Exception as e:  # noqa: BLE001 - a server without its model must not linger
            log.error("start-up failed: %s: %s", type(e).__name__, e)
            host.state = "failed"
            server.should_exit = True

    def watch():
        while not stop.wait(args.watch):
            live = host.live
            if host.ready and live is not None and host.source.resolve() != live.version.path:
                host.request_swap("watch").result()

    def on_startup(loop):
        loop.add_signal_handler(signal.SIGHUP, host.request_swap, "sighup")
        host.loader.submit(load_first)
        if args.artifacts and args.watch > 0:
            threading.Thread(target=watch, name="watch", daemon=True).start()

    def on_shutdown():
        stop.set()
        host.close()
        log.info("stopped")

    app = create_app(host, metrics, args.served_model_name, int(args.max_upload_mb * 2**20), args.queue_depth,
                     args.queue_timeout, on_startup, on_shutdown)
    app = RequestMetrics(UploadGuard(app, int(args.max_upload_mb * 2**20)), metrics)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=args.grace, lifespan="on", access_log=False)
    server = uvicorn.Server(config)
    # uvicorn re-raises the SIGTERM it handled once it has shut down; with a handler here that ends as exit 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    return 1 if host.state == "failed" else 0
