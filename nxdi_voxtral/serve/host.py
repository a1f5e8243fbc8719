"""The device side of the server: the live model version, the one thread that runs it, hot swap and recovery.

The device runs one sequence at a time, so every request runs as a job on a single worker thread. A job reads
`self.live` when it starts and keeps that model to the end; a swap replaces `self.live` from a job on the same
thread, so the request running at that moment finishes on the old version and every later one runs on the new
one: no request mixes versions, and none is dropped.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ArtifactError, AudioTooLongError, VoxtralError
from ..processing import SAMPLE_RATE, decode
from ..graphs import DTYPE_NAMES as DTYPES

log = logging.getLogger(__name__)


class RequestCancelled(Exception):
    """The client went away: generation stops at the next accepted token and frees the device."""


class WorkerDied(VoxtralError, RuntimeError):
    """A tensor-parallel rank process died under a request; the model is being reopened."""


class NotServing(VoxtralError, RuntimeError):
    """No live model (starting, restarting after a failure, or stopping)."""


@dataclass(frozen=True)
class Source:
    """Where versions come from: `artifacts` (a directory or the deploy `current` link, re-resolved on every
    swap), `model` (an HF checkpoint dir) or `demo` (the embedded synthetic model)."""
    kind: str
    path: str
    draft: str | None = None
    draft_kind: str | None = None
    k: int | None = None
    tp: int = 1
    dtype: str = "fp32"
    buckets: object = None  # graphs.Buckets for model / demo; artifacts carry their own
    backend: str = "eager"  # model / demo: from_pretrained's backend; artifacts carry their own

    def resolve(self) -> str:
        return os.path.realpath(self.path)


@dataclass(frozen=True)
class Version:
    id: str     # artifacts: sha256 of manifest.json; checkpoints: sha256 of the weight files' names/sizes/mtimes
    path: str   # the resolved directory (a release dir for artifacts)
    kind: str


def describe(source: Source, resolved: str) -> Version:
    root = Path(resolved)
    if source.kind == "artifacts":
        manifest = root / "manifest.json"
        digest = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else "no-manifest"
    else:
        h = hashlib.sha256()
        for p in sorted(root.iterdir()) if root.is_dir() else []:
            if p.is_file():
                st = p.stat()
                h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        digest = h.hexdigest()
    return Version(digest[:12], resolved, source.kind)


@dataclass
class Loaded:
    model: object
    version: Version

    def rank_pids(self) -> list[int]:
        return list(self.model.ranks.pids)

    def workers_dead(self) -> bool:
        return self.model.ranks.dead()


def open_model(source: Source, resolved: str):
    from ..application import NxDVoxtralSpecDec
    if source.kind == "artifacts":
        return NxDVoxtralSpecDec.from_artifacts(resolved)  # verifies the manifest: files, sizes, sha256, host
    return NxDVoxtralSpecDec.from_pretrained(resolved, draft=source.draft, draft_kind=source.draft_kind,
                                             num_speculative_tokens=source.k, dtype=DTYPES[source.dtype],
                                             buckets=source.buckets, tp_degree=source.tp, backend=source.backend)


def warm(m) -> None:
    """Every graph once (on Neuron the first call of a NEFF loads it), then one real transcription of 1 s of
    silence: a version that cannot do this never takes traffic. Stale KV rows written here are never read."""
    from ..graphs import example_inputs, graph_plan
    for spec in graph_plan(m.setup):
        m.run(spec.tag, spec.bucket, *example_inputs(spec, m.setup))
    p = m.prepare(np.zeros(SAMPLE_RATE, np.float32), sampling_rate=SAMPLE_RATE)
    room = m.setup.token_room(p.input_ids.shape[1])
    ids = m.generate(p.input_ids, p.input_features, max_new_tokens=max(1, min(8, room)))
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= m.cfg.text.vocab_size:
        raise ArtifactError(f"warm-up generated token ids outside the vocabulary: {ids.tolist()}")


def load_version(source: Source, resolved: str) -> Loaded:
    version = describe(source, resolved)
    t0 = time.perf_counter()
    m = open_model(source, resolved)
    try:
        warm(m)
    except BaseException:
        m.close()
        raise
    log.info("loaded and warmed %s version %s (%s) in %.1f s", source.kind, version.id, resolved,
             time.perf_counter() - t0)
    return Loaded(m, version)


class HoldForTests:
    """TEST HOOK, not a feature: with NXDI_VOXTRAL_TEST_HOLD=DIR in the environment (read once, when the Host is
    created; unset everywhere but tests/test_serve.py) a test can act on a request that is certainly mid-generation,
    with no timer. The test writes N to DIR/armed; the next request that starts takes that file, and once it has
    accepted N tokens (the deltas up to there emitted) it creates DIR/held and keeps the device until DIR/release
    exists or its client leaves (then it stops at the next token, as any cancelled request does)."""
    ENV = "NXDI_VOXTRAL_TEST_HOLD"

    def __init__(self, root: str):
        self.root = Path(root)

    def claim(self) -> int | None:
        try:
            at = int((self.root / "armed").read_text())
        except FileNotFoundError:
            return None
        (self.root / "armed").unlink()
        return at

    def hold(self, cancel: threading.Event) -> None:
        (self.root / "held").touch()
        while not (self.root / "release").exists() and not cancel.wait(0.01):
            pass


@dataclass(eq=False)
class Job:
    """One transcription request. `emit` (from the device thread) gets ("start", version) once prepare succeeded,
    then ("delta", text) per accepted token span when streaming."""
    audio: bytes          # the upload as sent (wav / flac / ogg / mp3): decoded on the device thread, admitted
    language: str | None
    max_new_tokens: int | None = None  # the request's own cap (vLLM's max_completion_tokens)
    stream: bool = False
    emit: object = None
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str
    duration_s: float
    prompt_tokens: int
    timings: dict
    stats: dict
    version: Version


class Host:
    def __init__(self, source: Source, metrics, max_new_tokens: int = 448):
        self.source, self.metrics, self.max_new_tokens = source, metrics, max_new_tokens
        self.device = ThreadPoolExecutor(1, thread_name_prefix="device")
        # Loads run on one long-lived thread: rank workers get SIGTERM when the *thread* that started them exits
        # (PR_SET_PDEATHSIG follows the thread), so a model must never be opened from a short-lived thread.
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="loader")
        self.live: Loaded | None = None
        self.state = "starting"  # starting | ready | recovering | stopping | failed
        self.load_lock = threading.Lock()  # one load (start-up, swap or recovery) at a time
        self.refused: tuple[str, str] | None = None
        self.last_swap: dict = {}
        self.active: set[Job] = set()
        hold_dir = os.environ.get(HoldForTests.ENV)  # test hook: unset outside tests/test_serve.py
        self.test_hold = HoldForTests(hold_dir) if hold_dir else None

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.live is not None

    def _set_state(self, state: str) -> None:
        self.state = state
        self.metrics.ready.set(1 if self.ready else 0)

    # ------------------------------------------------------------------ start-up, swap, recovery, shutdown
    def start(self) -> None:
        """Load and warm the first version (blocking; the server answers /health/live meanwhile)."""
        with self.load_lock:
            loaded = load_version(self.source, self.source.resolve())
            self.live = loaded
            self.metrics.set_version(loaded.version)
            self._set_state("ready")

    def request_swap(self, reason: str) -> Future:
        return self.loader.submit(self.swap, reason)

    def swap(self, reason: str) -> dict:
        """On the loader thread: load, verify and warm what the source points at now beside the live version, then switch between two
        requests. A version that fails any step is refused (logged, counted) and the live one stays."""
        with self.load_lock:
            live = self.live.version if self.live else None
            if live is None or self.state == "stopping":
                return {"result": "skipped", "reason": f"state {self.state}"}
            resolved = self.source.resolve()
            version = describe(self.source, resolved)
            if (version.path, version.id) == (live.path, live.id):
                return {"result": "unchanged", "version": live.id}
            if reason == "watch" and (version.path, version.id) == self.refused:
                return {"result": "refused-before", "version": version.id}  # retried on SIGHUP only
            log.info("hot swap (%s): loading %s beside live %s", reason, resolved, live.id)
            try:
                new = load_version(self.source, resolved)
            except Exception as e:  # noqa: BLE001 - any failure refuses the version
                self.refused = (version.path, version.id)
                self.metrics.swaps.labels("refused").inc()
                self.last_swap = {"result": "refused", "version": version.id, "path": resolved,
                                  "error": f"{type(e).__name__}: {e}"}
                log.error("hot swap refused %s (%s): %s: %s; %s stays live", resolved, version.id,
                          type(e).__name__, e, live.id)
                return self.last_swap
            try:
                old = self.device.submit(self._switch, new).result()  # runs between two requests
            except RuntimeError:  # shutting down
                new.model.close()
                return {"result": "skipped", "reason": "stopping"}
            if old is not None:
                old.model.close()
            self.metrics.swaps.labels("ok").inc()
            self.last_swap = {"result": "ok", "version": new.version.id, "path": resolved, "previous": live.id}
            log.info("hot swap: %s is live (was %s)", new.version.id, live.id)
            return self.last_swap

    def _switch(self, new: Loaded) -> Loaded | None:
        old, self.live = self.live, new
        self.metrics.set_version(new.version)
        if self.state in ("recovering", "failed"):  # a good new version also ends a failed recovery
            self._set_state("ready")
        return old

    def _recover(self, dead: Loaded) -> None:
        """On the device thread, right after the failed request: reopen the same version; not ready meanwhile.
        Not under load_lock: a swap holding it waits for this thread to run its switch."""
        t0 = time.perf_counter()
        dead.model.close()
        try:
            self.live = load_version(self.source, dead.version.path)
        except Exception as e:  # noqa: BLE001
            self.live = None
            self._set_state("failed")
            log.error("recovery failed: %s: %s; the server stays unready (liveness fails)", type(e).__name__, e)
            return
        self.metrics.restarts.inc()
        self._set_state("ready")
        log.warning("rank workers restarted, %s live again after %.1f s", self.live.version.id,
                    time.perf_counter() - t0)

    def close(self) -> None:
        """Stop: cancel what still runs (uvicorn already waited the grace period), stop the rank workers."""
        self._set_state("stopping")
        for job in list(self.active):
            job.cancel.set()
        self.loader.shutdown(wait=True, cancel_futures=True)
        self.device.shutdown(wait=True, cancel_futures=True)
        if self.live is not None:
            self.live.model.close()
            self.live = None

    # ------------------------------------------------------------------ requests
    def submit(self, job: Job) -> Future:
        return self.device.submit(self._run, job)

    def _run(self, job: Job) -> Result:
        loaded = self.live
        if loaded is None or self.state not in ("ready",):
            raise NotServing(f"model not available (state {self.state})")
        if job.cancel.is_set():
            raise RequestCancelled()
        self.active.add(job)
        self.metrics.running.set(1)
        try:
            return self._transcribe(loaded, job)
        except (RequestCancelled, VoxtralError) as e:
            if isinstance(e, RequestCancelled) or not loaded.workers_dead():
                raise
            error = e
        except Exception as e:  # noqa: BLE001 - a dead rank shows up as a broken pipe or EOF too
            if not loaded.workers_dead():
                raise
            error = e
        finally:
            self.active.discard(job)
            self.metrics.running.set(0)
        # a rank process died under this request: fail it clearly, reopen the model before the next request
        self._set_state("recovering")
        log.error("a tensor-parallel rank died mid-request (%s: %s); reopening %s", type(error).__name__,
                  str(error).splitlines()[0] if str(error) else "", loaded.version.id)
        self.device.submit(self._recover, loaded)
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise WorkerDied(f"a tensor-parallel rank worker died during this request ({cause}); the model is being "
                         f"restarted, retry") from error

    def _transcribe(self, loaded: Loaded, job: Job) -> Result:
        m, t0 = loaded.model, time.perf_counter()
        prompt = m.prepare(job.audio, job.language)
        prompt_len = prompt.input_ids.shape[1]
        room = m.setup.token_room(prompt_len)
        if room < 1:
            raise AudioTooLongError(f"a prompt of {prompt_len} tokens leaves no room in the largest KV bucket "
                                    f"({m.buckets.kv_lengths[-1]})")
        max_new = min(self.max_new_tokens, room, job.max_new_tokens or self.max_new_tokens)
        timings = {"features_s": time.perf_counter() - t0}
        if job.emit:
            job.emit(("start", loaded.version))
        pending: list[int] = []  # streamed ids whose text is not out yet (an incomplete UTF-8 sequence)
        hold_at = self.test_hold.claim() if self.test_hold else None  # test hook (HoldForTests)
        accepted = 0

        def on_tokens(new_ids):
            nonlocal hold_at, accepted
            if job.cancel.is_set():
                self.metrics.cancelled.inc()
                raise RequestCancelled()
            if job.stream:
                pending.extend(new_ids)
                text = decode(m.tokenizer, pending)
                if text and not text.endswith("\ufffd"):
                    job.emit(("delta", text))
                    pending.clear()
            accepted += len(new_ids)
            if hold_at is not None and accepted >= hold_at:  # test hook (HoldForTests)
                hold_at = None
                self.test_hold.hold(job.cancel)

        ids, stats = m.generate(prompt.input_ids, prompt.input_features, max_new, timings, True, on_tokens=on_tokens)
        ids = ids[0].tolist()
        if job.stream and pending:
            job.emit(("delta", decode(m.tokenizer, pending)))
        timings["total_s"] = time.perf_counter() - t0
        eos = m.cfg.text.eos_token_id
        summary = stats.summary()
        self.metrics.tokens.inc(len(ids))
        self.metrics.audio_seconds.inc(prompt.duration_s)
        if m.setup.draft_kind and stats.verify_calls:
            self.metrics.tau.observe(stats.tau)
        self.metrics.passes_per_token.observe(stats.target_passes / max(1, len(ids)))
        return Result(text=decode(m.tokenizer, ids), token_ids=ids, finish_reason="stop" if ids[-1] == eos else "length",
                      duration_s=prompt.duration_s, prompt_tokens=prompt_len, timings=timings, stats=summary,
                      version=loaded.version)
