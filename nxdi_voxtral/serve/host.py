"""The device side of the server: the live model version, the one thread that drives it, hot swap and recovery.

One device thread runs a continuous-batching loop over the live model (`Host._device_loop`). Admitted requests
wait in `Host.waiting`; between two steps the loop gives free KV slots to them (audio decoded, prefilled, first
token emitted), then advances every active sequence by one target pass; a sequence leaves its slot when it
finishes or its client goes. Each sequence's tokens are exactly what it gets alone (generate.py), whatever joins
or leaves around it.

A request is one sequence when its upload fits the largest audio bucket. A longer upload (up to --max-audio-s) is
cut into windows at quiet points, as `NxDVoxtralSpecDec.transcribe` cuts it, and each window is a sequence of the
batch: the windows are decoded one at a time as slots free up, so one file fills the spare slots, and its text is
the windows' texts joined in order.

A request keeps the model it was prefilled on to the end, all its windows included. A swap runs on the device thread
once the requests running have finished (no new one joins meanwhile; the windows of those running go on), so they
finish on the old version and every later one runs on the new one: no request mixes versions, and none is dropped.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from .. import generate as gen
from ..application import MAX_AUDIO_S, Segment
from ..errors import ArtifactError, AudioTooLongError, ConfigError, VoxtralError
from ..processing import SAMPLE_RATE, Prompt, decode
from ..speculative import SpecStats
from ..graphs import DTYPE_NAMES as DTYPES, batch_sizes_up_to

log = logging.getLogger(__name__)


class RequestCancelled(Exception):
    """The client went away: its sequences leave the batch at the next step boundary and free their KV slots."""


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
    batch: gen.Batch = field(init=False)  # the model's KV slots and the sequences in them

    def __post_init__(self):
        self.batch = gen.Batch(self.model.buckets)

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


def check_slots(m, max_batch: int, path: str) -> None:
    """--max-batch needs that many KV slots (the largest batch bucket); a release carries its own."""
    slots = m.buckets.max_batch
    if max_batch > slots:
        wanted = ",".join(map(str, batch_sizes_up_to(max_batch)))
        raise ConfigError(f"--max-batch {max_batch} needs {max_batch} KV slots, but {path} has {slots} (batch buckets "
                          f"{','.join(map(str, m.buckets.batch_sizes))}): rebuild it with --buckets ...:batch={wanted} "
                          f"(from_pretrained(..., max_batch_size={max_batch}) in Python), or serve it with "
                          f"--max-batch {slots}")


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


def load_version(source: Source, resolved: str, max_batch: int) -> Loaded:
    version = describe(source, resolved)
    t0 = time.perf_counter()
    m = open_model(source, resolved)
    try:
        check_slots(m, max_batch, resolved)
        warm(m)
    except BaseException:
        m.close()
        raise
    log.info("loaded and warmed %s version %s (%s) in %.1f s", source.kind, version.id, resolved,
             time.perf_counter() - t0)
    if max_batch < m.buckets.max_batch:
        log.info("serving at most %d sequences at once of the %d KV slots this version has (--max-batch)", max_batch,
                 m.buckets.max_batch)
    return Loaded(m, version)


class HoldForTests:
    """TEST HOOK, not a feature: with NXDI_VOXTRAL_TEST_HOLD=DIR in the environment (read once, when the Host is
    created; unset everywhere but tests/test_serve.py) a test can act on a request that is certainly mid-generation,
    with no timer. The test writes N to DIR/armed; the next request that starts takes that file, and once it has
    accepted N tokens (over all its windows; the deltas up to there emitted) with sequences still in the batch, the
    device loop creates DIR/held and pauses between two steps (the whole batch with it; requests that arrive
    meanwhile wait to join) until DIR/release exists or that request's client leaves (then its sequences leave the
    batch at once, as any cancelled one's do).
    A hold consumes DIR/release as it ends, so a test may arm the next hold while one is held."""
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
        (self.root / "release").unlink(missing_ok=True)


@dataclass(eq=False)
class Job:
    """One transcription request. `emit` (from the device thread) gets ("start", version) once its first prompt is
    ready, then ("delta", text) per accepted token span when streaming."""
    audio: bytes          # the upload as sent (wav / flac / ogg / mp3): decoded on the device thread, admitted
    audio_s: float        # its length from the container's header (app.upload_seconds): one prompt or windows
    language: str | None
    max_new_tokens: int | None = None  # the request's own cap, per window (vLLM's max_completion_tokens)
    stream: bool = False
    emit: object = None
    cancel: threading.Event = field(default_factory=threading.Event)
    queued: float = field(default_factory=time.perf_counter)  # when it entered admission: its queue wait starts


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
    segments: list[Segment]  # one per window, in order (one covering the audio when it fits one prompt)


def joined(texts: list[str], windowed: bool) -> str:
    """A request's text: its one prompt's as generated, or its windows' stripped and joined with " " (as
    NxDVoxtralSpecDec.transcribe joins them)."""
    return " ".join(t.strip() for t in texts) if windowed else texts[0]


class OrderedStream:
    """A streaming request's deltas, in window order: the tokens of a window are held back until every earlier
    window is complete, then flushed, so the stream adds up to `joined(...)` of the windows' texts. A windowed
    request's window is stripped as it streams (whitespace is held until more text follows it, so a window's
    trailing whitespace is never sent) and every window after the first begins with the " " that joins it."""

    def __init__(self, emit, tokenizer, windowed: bool):
        self.emit, self.tokenizer, self.windowed = emit, tokenizer, windowed
        self.unsent: dict[int, list[int]] = {}  # window -> accepted ids whose text is not out yet
        self.complete: set[int] = set()
        self.current = 0       # the window being sent
        self.begun = False     # the current window sent its text's start (its separator, its first non-blank)
        self.blank = ""        # whitespace of the current window held back

    def tokens(self, window: int, new_ids: list[int]) -> None:
        """A window's sequence accepted new_ids (called inside a step: must not raise)."""
        self.unsent.setdefault(window, []).extend(new_ids)
        if window == self.current:
            self._send(final=False)

    def window_done(self, window: int) -> None:
        self.complete.add(window)
        while self.current in self.complete:
            self._send(final=True)
            self.complete.remove(self.current)
            self.unsent.pop(self.current, None)
            self.current, self.begun, self.blank = self.current + 1, False, ""
            if self.current not in self.complete:
                self._send(final=False)  # what the next window accepted while this one ran

    def _send(self, final: bool) -> None:
        ids = self.unsent.get(self.current, [])
        text = decode(self.tokenizer, ids) if ids else ""
        if not final and (not text or text.endswith("\ufffd")):  # a character cut mid-UTF-8: wait for the rest
            return
        ids.clear()
        if self.windowed:
            text = self.blank + (text if self.begun else text.lstrip())
            body = text.rstrip()
            self.blank = text[len(body):]
            if not body and not final:
                return
            text = (" " if self.current > 0 and not self.begun else "") + body
            self.begun = True
        if text:
            self.emit(("delta", text))


@dataclass(eq=False)
class Request:
    """An admitted request on the device: the prompts of its upload still to come (a generator: each window is
    decoded when it is pulled for a free slot), its windows started so far, the version it runs on to the end."""
    job: Job
    future: Future
    loaded: Loaded
    prompts: Iterator[tuple[float, float, Prompt]] | None  # (start_s, end_s, prompt); None once all were pulled
    windowed: bool
    started: float         # when the device loop took it (its total_s starts)
    timings: dict
    hold_at: int | None    # test hook (HoldForTests)
    stream: OrderedStream | None
    windows: list["Running"] = field(default_factory=list)  # in order
    active: int = 0        # its sequences in the batch now


@dataclass(eq=False)
class Running:
    """One window of a request in the batch (its whole upload when that fits one prompt): the window's sequence
    and its place in the audio."""
    request: Request
    index: int
    start_s: float
    end_s: float
    prompt_tokens: int
    audio_s: float  # the prompt's own audio (what the audio-seconds metric counts); its features are not kept
    seq: gen.Sequence | None = None


# Prefills admitted between two steps while other sequences are active. A prefill (audio decode, encoder, context
# encoding of the whole prompt) costs many decode steps and every active sequence waits for it: one per step bounds
# that stall to one prefill per generated token, and a waiting request still joins within one step per request
# ahead of it. With nothing active nobody waits, and every free slot is filled at once.
PREFILLS_PER_STEP = 1


class Host:
    def __init__(self, source: Source, metrics, max_new_tokens: int = 448, max_batch: int = 1,
                 max_audio_s: float = MAX_AUDIO_S):
        self.source, self.metrics, self.max_new_tokens, self.max_batch = source, metrics, max_new_tokens, max_batch
        self.max_audio_s = max_audio_s  # the longest upload, cut into windows past the largest audio bucket
        from .metrics import BatchMetrics  # here: open_model / warm serve without the server's dependencies too
        self.batch_metrics = BatchMetrics(metrics.registry, max_batch)
        # Loads run on one long-lived thread: rank workers get SIGTERM when the *thread* that started them exits
        # (PR_SET_PDEATHSIG follows the thread), so a model must never be opened from a short-lived thread.
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="loader")
        self.live: Loaded | None = None
        self.state = "starting"  # starting | ready | recovering | stopping | failed
        self.load_lock = threading.Lock()  # one load (start-up, swap or recovery) at a time
        self.refused: tuple[str, str] | None = None
        self.last_swap: dict = {}
        # the device loop's queues, under `wake`: requests waiting to join the batch, work to run on a drained batch
        self.wake = threading.Condition()
        self.waiting: deque[tuple[Job, Future]] = deque()
        self.on_drained: deque[tuple[Future, object, tuple]] = deque()
        self.stopped = False
        # the device thread's own: the requests it has taken (in that order) and the batch's sequences (windows)
        self.requests: list[Request] = []
        self.running: dict[gen.Sequence, Running] = {}
        hold_dir = os.environ.get(HoldForTests.ENV)  # test hook: unset outside tests/test_serve.py
        self.test_hold = HoldForTests(hold_dir) if hold_dir else None
        # Recovery reopens models on this thread: it lives as long as the Host (see the loader above)
        self.device = threading.Thread(target=self._device_loop, name="device", daemon=True)
        self.device.start()

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.live is not None

    def _set_state(self, state: str) -> None:
        self.state = state
        self.metrics.ready.set(1 if self.ready else 0)

    def batch_status(self) -> dict:
        """The batch now and its recent history (for /health)."""
        loaded = self.live
        return {"max_batch": self.max_batch, "running": len(self.running), "waiting": len(self.waiting),
                "swap_pending": bool(self.on_drained),  # admissions paused until the running requests finish
                "kv_slots": loaded.model.buckets.max_batch if loaded else None,
                "free_kv_slots": len(loaded.batch.free) if loaded else None, **self.batch_metrics.summary()}

    # ------------------------------------------------------------------ start-up, swap, recovery, shutdown
    def start(self) -> None:
        """Load and warm the first version (blocking; the server answers /health/live meanwhile)."""
        with self.load_lock:
            loaded = load_version(self.source, self.source.resolve(), self.max_batch)
            self.live = loaded
            self.metrics.set_version(loaded.version)
            self._set_state("ready")

    def request_swap(self, reason: str) -> Future:
        return self.loader.submit(self.swap, reason)

    def swap(self, reason: str) -> dict:
        """On the loader thread: load, verify and warm what the source points at now beside the live version, then
        switch once the batch has drained. A version that fails any step is refused (logged, counted) and the live
        one stays."""
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
                new = load_version(self.source, resolved, self.max_batch)
            except Exception as e:  # noqa: BLE001 - any failure refuses the version
                self.refused = (version.path, version.id)
                self.metrics.swaps.labels("refused").inc()
                self.last_swap = {"result": "refused", "version": version.id, "path": resolved,
                                  "error": f"{type(e).__name__}: {e}"}
                log.error("hot swap refused %s (%s): %s: %s; %s stays live", resolved, version.id,
                          type(e).__name__, e, live.id)
                return self.last_swap
            try:
                old = self._on_drained_batch(self._switch, new).result()
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
        """On the device thread, right after failing the batch: reopen the same version; not ready meanwhile.
        Not under load_lock: a swap holding it waits for this thread to run its switch."""
        t0 = time.perf_counter()
        dead.model.close()
        try:
            self.live = load_version(self.source, dead.version.path, self.max_batch)
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
        if self.state != "failed":  # a failed start-up or recovery stays failed: the process exits 1
            self._set_state("stopping")
        with self.wake:
            for job, _ in self.waiting:
                job.cancel.set()
        for request in list(self.requests):
            request.job.cancel.set()
        self.loader.shutdown(wait=True, cancel_futures=True)  # a swap under way switches on the drained batch
        with self.wake:
            self.stopped = True
            self.wake.notify()
        self.device.join()
        if self.live is not None:
            self.live.model.close()
            self.live = None

    # ------------------------------------------------------------------ requests
    def submit(self, job: Job) -> Future:
        """Queue an admitted request for the device loop -> the future of its Result."""
        future = Future()
        with self.wake:
            if self.stopped:
                future.set_exception(NotServing("the server is stopping"))
            else:
                self.waiting.append((job, future))
                self.wake.notify()
        return future

    def _on_drained_batch(self, fn, *args) -> Future:
        """Run fn(*args) on the device thread once no request runs (new ones wait meanwhile; the windows of those
        running go on) -> its future; RuntimeError once the loop has stopped."""
        future = Future()
        with self.wake:
            if self.stopped:
                future.set_exception(RuntimeError("the device loop has stopped"))
            else:
                self.on_drained.append((future, fn, args))
                self.wake.notify()
        return future

    def _device_loop(self) -> None:
        """Rounds until close(): drop cancelled requests; fill free slots (with new requests too unless a swap waits
        for the running ones to finish); step every active sequence once."""
        try:
            while self._wait_for_work():
                self._drop_cancelled()
                if self.on_drained and not self.requests:
                    self._run_call()
                    continue
                self._admit(new_requests=not self.on_drained)
                if self.running:
                    self._step()
                if self.test_hold:
                    self._test_hold()
        except Exception:  # a bug in the loop itself: fail loudly rather than leave every request hanging
            log.exception("the device loop failed; the server stays unready (liveness fails)")
            self._set_state("failed")
            for request in self.requests:
                if not request.future.done():
                    request.future.set_exception(NotServing("the device loop failed"))
            self.requests.clear()
            self.running.clear()
        with self.wake:
            self.stopped = True
        self._fail_waiting(NotServing(f"the device loop has stopped (state {self.state})"))
        while self.on_drained:
            self.on_drained.popleft()[0].set_exception(RuntimeError("the device loop has stopped"))

    def _wait_for_work(self) -> bool:
        """Sleep until there is something to do -> False once stopped with nothing running."""
        with self.wake:
            while not (self.requests or self.waiting or self.on_drained or self.stopped):
                self.wake.wait()
            return not (self.stopped and not self.requests)

    def _run_call(self) -> None:
        with self.wake:
            future, fn, args = self.on_drained.popleft()
        try:
            future.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 - the caller gets it
            future.set_exception(e)

    def _fail_waiting(self, error: Exception) -> None:
        with self.wake:
            waiting, self.waiting = list(self.waiting), deque()
        for _, future in waiting:
            if future.set_running_or_notify_cancel():  # False: the client's side already cancelled it
                future.set_exception(error)

    def _drop_cancelled(self) -> None:
        """Requests whose client left: a running one frees its slots now, a waiting one leaves the queue."""
        for request in list(self.requests):
            if request.job.cancel.is_set():
                self._end(request, RequestCancelled())
                self.metrics.cancelled.inc()
        self.metrics.running.set(len(self.running))
        with self.wake:
            gone = [item for item in self.waiting if item[0].cancel.is_set()]
            for item in gone:
                self.waiting.remove(item)
        for _, future in gone:
            if future.set_running_or_notify_cancel():
                future.set_exception(RequestCancelled())

    def _end(self, request: Request, error: Exception) -> None:
        """Fail a request: its sequences leave the batch (their slots free for the next step) and its windows not
        started are never decoded."""
        for r in request.windows:
            if self.running.pop(r.seq, None) is not None:
                request.loaded.batch.release(r.seq)
        if request.prompts is not None:
            request.prompts.close()
        self.requests.remove(request)
        request.future.set_exception(error)

    def _admit(self, new_requests: bool) -> None:
        """Fill free slots between two steps. Each goes to the request with the fewest sequences in the batch, the
        earliest taken on a tie, a waiting request counting as none: a new request joins at once however long the
        files before it, and the slots to spare go to the next windows of long ones."""
        loaded = self.live
        if loaded is None or self.state != "ready":
            self._fail_waiting(NotServing(f"model not available (state {self.state})"))
            return
        free = min(len(loaded.batch.free), self.max_batch - len(self.running))
        prefills = free if not self.running else min(free, PREFILLS_PER_STEP)
        while prefills > 0 and self.live is loaded:  # a rank died under the last prefill: admit on the reopened one
            request = self._next_for_slot(loaded, new_requests)
            if request is None:
                return
            if self._start_window(request):
                prefills -= 1

    def _next_for_slot(self, loaded: Loaded, new_requests: bool) -> Request | None:
        with_windows = [r for r in self.requests if r.prompts is not None]
        fewest = min(with_windows, key=lambda r: r.active, default=None)  # min keeps the first of equals
        if fewest is not None and (fewest.active == 0 or not new_requests):
            return fewest
        while new_requests:
            with self.wake:
                if not self.waiting:
                    break
                job, future = self.waiting.popleft()
            if future.set_running_or_notify_cancel():  # False: the client's side already cancelled it
                return self._take(loaded, job, future)
        return fewest

    def _take(self, loaded: Loaded, job: Job, future: Future) -> Request:
        t0, m = time.perf_counter(), loaded.model
        self.batch_metrics.waited(t0 - job.queued)
        windowed = job.audio_s > m.buckets.max_audio_seconds(m.cfg)
        request = Request(job, future, loaded, self._prompts(m, job, windowed), windowed, t0,
                          {"queue_s": t0 - job.queued, "features_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0},
                          hold_at=self.test_hold.claim() if self.test_hold else None,
                          stream=OrderedStream(job.emit, m.tokenizer, windowed) if job.stream else None)
        self.requests.append(request)
        return request

    def _prompts(self, m, job: Job, windowed: bool) -> Iterator[tuple[float, float, Prompt]]:
        """The upload's prompts in order, with their place in it (seconds): one of the whole upload when it fits
        the largest audio bucket (the model's prepare), else one per window cut as NxDVoxtralSpecDec.transcribe
        cuts them. A generator: a window is decoded (and its header checked, for the first) when it is pulled."""
        if not windowed:
            prompt = m.prepare(job.audio, job.language)
            yield 0.0, prompt.duration_s, prompt
            return
        yield from m.window_prompts(job.audio, job.language, max_audio_s=self.max_audio_s)

    def _start_window(self, request: Request) -> bool:
        """Pull the request's next prompt (decoding its window) and prefill it -> False when it had none left (then
        it finishes, unless some of it still runs)."""
        t0 = time.perf_counter()
        try:
            item = next(request.prompts, None)
        except Exception as e:  # noqa: BLE001 - the upload does not decode (further): this request's failure
            self._end(request, e)
            self.metrics.running.set(len(self.running))
            return True
        request.timings["features_s"] += time.perf_counter() - t0
        if not request.windowed and item is not None:  # its one prompt: done pulling, so it finishes with its sequence
            request.prompts.close()
            request.prompts = None
        if item is None:  # every window was pulled
            request.prompts = None
            if not request.active:
                self._finish(request)
            return False
        self._prefill(request, *item)
        return True

    def _prefill(self, request: Request, start_s: float, end_s: float, prompt: Prompt) -> None:
        """Prefill a window into a free slot (its first token emitted) and add its sequence to the batch."""
        job, loaded = request.job, request.loaded
        m = loaded.model
        try:
            ids, features = m.check_inputs(prompt.input_ids, prompt.input_features)
            prompt_len = ids.shape[1]
            room = m.setup.token_room(prompt_len)
            if room < 1:
                raise AudioTooLongError(f"a prompt of {prompt_len} tokens leaves no room in the largest KV bucket "
                                        f"({m.buckets.kv_lengths[-1]})")
            max_new = min(self.max_new_tokens, room, job.max_new_tokens or self.max_new_tokens)
            r = Running(request, len(request.windows), start_s, end_s, prompt_len, prompt.duration_s)
            if job.emit and not request.windows:
                job.emit(("start", loaded.version))
            t1 = time.perf_counter()
            # the slot leaves the free list only once its prefill succeeded
            r.seq = m.start(ids, features, max_new, loaded.batch.free[0], r.index,
                            on_tokens=request.stream.tokens if request.stream else None)
            loaded.batch.take_slot()
        except Exception as e:  # noqa: BLE001 - this request's failure, unless a rank died under it
            if loaded.workers_dead():
                self._workers_died(loaded, e)
            else:
                self._end(request, e)
            self.metrics.running.set(len(self.running))
            return
        prefill_s = time.perf_counter() - t1
        request.timings["prefill_s"] += prefill_s
        self.batch_metrics.prefilled(prefill_s)
        request.windows.append(r)
        request.active += 1
        loaded.batch.active.append(r.seq)
        self.running[r.seq] = r
        if r.seq.done:
            loaded.batch.release(r.seq)
            self._window_done(self.running.pop(r.seq))
        self.metrics.running.set(len(self.running))

    def _step(self) -> None:
        loaded = self.live  # every running sequence was prefilled on it: a swap or a recovery waits for none to run
        m, batch = loaded.model, loaded.batch
        stepped = list(batch.active)
        before, t0 = sum(len(s.tokens) for s in stepped), time.perf_counter()
        try:
            finished = batch.step(m.run, m.drafter, m.setup.k)
        except Exception as e:  # noqa: BLE001 - fails the whole batch: some sequences may have advanced, some not
            if loaded.workers_dead():
                self._workers_died(loaded, e)
                return
            log.error("a decode step failed (%s: %s); its %d requests fail", type(e).__name__, e,
                      len(self.requests))
            for request in list(self.requests):
                self._end(request, e)
            self.metrics.running.set(0)
            loaded.batch = gen.Batch(m.buckets)  # every slot free again, whatever state the failed step left
            return
        step_s = time.perf_counter() - t0
        self.batch_metrics.stepped(len(stepped), sum(len(s.tokens) for s in stepped) - before, step_s)
        for request in {self.running[seq].request for seq in stepped}:  # a request's decode time, once per step
            request.timings["decode_s"] += step_s
        for seq in finished:
            self._window_done(self.running.pop(seq))
        self.metrics.running.set(len(self.running))

    def _workers_died(self, loaded: Loaded, error: Exception) -> None:
        """A rank process died under the batch: fail every request on the device clearly, then reopen the model
        before the next one (readiness drops first, so no client sees the error while the server still reports
        ready)."""
        self._set_state("recovering")
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        log.error("a tensor-parallel rank died mid-request (%s: %s); reopening %s", type(error).__name__, cause,
                  loaded.version.id)
        requests = list(self.requests)
        self.requests.clear()
        self.running.clear()
        self.metrics.running.set(0)
        for request in requests:
            died = WorkerDied(f"a tensor-parallel rank worker died during this request ({cause}); the model is being "
                              f"restarted, retry")
            died.__cause__ = error
            request.future.set_exception(died)
        self._recover(loaded)

    def _window_done(self, r: Running) -> None:
        """A window's sequence finished (its slot is free): its stream flushes in order; the request finishes with
        its last window."""
        request = r.request
        request.active -= 1
        r.seq.stats.generated = len(r.seq.tokens)
        if request.stream:
            request.stream.window_done(r.index)
        if request.prompts is None and not request.active:
            self._finish(request)

    def _finish(self, request: Request) -> None:
        self.requests.remove(request)
        m, timings, windows = request.loaded.model, request.timings, request.windows
        segments = [Segment(r.start_s, r.end_s, decode(m.tokenizer, r.seq.tokens), list(r.seq.tokens))
                    for r in windows]
        ids = [t for s in segments for t in s.token_ids]
        steps = len(ids) - len(windows)  # each window's first token comes from its prefill
        timings.update(new_tokens=len(ids), total_s=time.perf_counter() - request.started,
                       decode_tokens_per_s=steps / timings["decode_s"] if steps and timings["decode_s"] > 0 else 0.0)
        stats = SpecStats.merged([r.seq.stats for r in windows])
        self.metrics.tokens.inc(len(ids))
        self.metrics.audio_seconds.inc(sum(r.audio_s for r in windows))
        if m.setup.draft_kind and stats.verify_calls:
            self.metrics.tau.observe(stats.tau)
        self.metrics.passes_per_token.observe(stats.target_passes / max(1, len(ids)))
        eos = m.cfg.text.eos_token_id
        request.future.set_result(Result(
            text=joined([s.text for s in segments], request.windowed), token_ids=ids,
            finish_reason="stop" if all(s.token_ids[-1] == eos for s in segments) else "length",
            duration_s=segments[-1].end, prompt_tokens=sum(r.prompt_tokens for r in windows),
            timings=timings, stats=stats.summary(), version=request.loaded.version, segments=segments))

    def _test_hold(self) -> None:
        """Test hook (HoldForTests): pause between two steps once the armed request has accepted its N tokens."""
        for request in list(self.requests):
            accepted = sum(len(r.seq.tokens) for r in request.windows)
            if request.hold_at is not None and request.active and accepted >= request.hold_at:
                request.hold_at = None
                self.test_hold.hold(request.job.cancel)
