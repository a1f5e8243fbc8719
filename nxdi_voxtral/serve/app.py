"""The HTTP side: OpenAI / vLLM audio API, health, metrics, admission (FastAPI on uvicorn).

Multipart parsing is Starlette's (python-multipart), field validation FastAPI's (pydantic); what is ours is the
mapping of every failure to OpenAI's error shape with the right status, and the admission queue.
"""
from __future__ import annotations

import asyncio
import io
import json
import logging
import time
import uuid
from typing import Literal

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import TypeAdapter, ValidationError
from pydantic_extra_types.language_code import LanguageAlpha2
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..errors import AudioError, AudioTooLongError, ConfigError
from ..processing import audio_header
from .host import Host, Job, NotServing, RequestCancelled, WorkerDied

log = logging.getLogger(__name__)
TRANSCRIBE = "/v1/audio/transcriptions"
ENDPOINTS = {TRANSCRIBE, "/v1/models", "/health", "/health/live", "/health/ready", "/metrics"}
LANGUAGE = TypeAdapter(LanguageAlpha2)


class ApiError(HTTPException):
    """An error the client sees in OpenAI's shape. An HTTPException so that FastAPI's body parsing re-raises it
    (it turns other exceptions raised while reading the body into a generic 400)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None, headers: dict | None = None):
        super().__init__(status, message, headers)
        self.message, self.code, self.param = message, code, param


def error_response(status: int, message: str, code: str | None, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def busy(message: str, code: str, retry_after: int) -> ApiError:
    return ApiError(503, message, code, headers={"Retry-After": str(retry_after)})


class Admission:
    """`slots` places in the device's batch (the host's --max-batch) and a bounded queue in front of them: a request
    past `depth` waiting, or waiting longer than `timeout_s`, gets 503 + Retry-After. A slot is released when the
    device job ends, not when the handler returns: a request whose client left keeps it until its sequence has left
    the batch."""

    def __init__(self, depth: int, timeout_s: float, metrics, slots: int = 1):
        self.depth, self.timeout_s, self.metrics = depth, timeout_s, metrics
        self.slots = asyncio.Semaphore(slots)
        self.waiting = 0

    def retry_after(self) -> int:
        return max(1, int(self.timeout_s))

    async def acquire(self) -> None:
        if self.waiting >= self.depth:
            self.metrics.rejected.labels("queue_full").inc()
            raise busy(f"server busy: {self.waiting} requests already waiting (queue depth {self.depth})",
                       "queue_full", self.retry_after())
        self.waiting += 1
        self.metrics.queue_depth.set(self.waiting)
        try:
            await asyncio.wait_for(self.slots.acquire(), self.timeout_s)
        except asyncio.TimeoutError:
            self.metrics.rejected.labels("queue_timeout").inc()
            raise busy(f"server busy: waited {self.timeout_s:g} s for the device", "queue_timeout",
                       self.retry_after()) from None
        finally:
            self.waiting -= 1
            self.metrics.queue_depth.set(self.waiting)

    def release(self) -> None:
        self.slots.release()


class UploadGuard:
    """ASGI middleware for the upload route: 415 for a body that is not multipart/form-data, 413 past the byte
    limit (checked on Content-Length and counted while reading, for chunked uploads). The body of a refused request
    is read and discarded first, so the client gets the status instead of a reset connection."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != TRANSCRIBE or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        ctype = headers.get(b"content-type", b"").decode("latin-1").lower()
        if not ctype.startswith("multipart/form-data"):
            await drain(receive, 4 * self.max_bytes)
            return await error_response(415, f"unsupported media type {ctype or '(none)'!r}: send the audio as "
                                        f"multipart/form-data (field 'file')", "unsupported_media_type",
                                        None)(scope, receive, send)
        declared = int(headers.get(b"content-length", b"-1") or -1)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes or declared > self.max_bytes:
                    if msg.get("more_body"):
                        await drain(receive, 4 * self.max_bytes)
                    raise ApiError(413, f"upload of {max(seen, declared)} bytes exceeds the limit of "
                                   f"{self.max_bytes} bytes", "upload_too_large", "file")
            return msg
        await self.app(scope, limited, send)


async def drain(receive, cap: int) -> None:
    seen = 0
    while seen <= cap:
        msg = await receive()
        if msg["type"] != "http.request" or not msg.get("more_body"):
            return
        seen += len(msg.get("body", b""))


class RequestMetrics:
    """ASGI middleware: count and time every request by endpoint and status; 499 when the client left first."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, t0 = 499, time.perf_counter()

        async def tracking_send(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)
        try:
            await self.app(scope, receive, tracking_send)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint, str(status)).observe(time.perf_counter() - t0)


def upload_seconds(data: bytes) -> float:
    """Seconds of audio in an upload, from its container's header (wav / flac / ogg / mp3): nothing is decoded
    here. A small compressed file can hold hours of audio; past --max-audio-s it is refused (413) on this number
    before admission, and the decoding itself runs under admission, on the device thread (Host), window by window."""
    if not data:
        raise ApiError(400, "the uploaded file is empty", "invalid_audio", "file")
    try:
        frames, sr, _ = audio_header(lambda: io.BytesIO(data), "uploaded audio")
    except AudioError as e:
        raise ApiError(400, f"the uploaded file is not readable audio ({e})", "invalid_audio", "file") from None
    return frames / sr


AUDIO_TYPES = ("audio/", "video/", "application/octet-stream", "application/ogg")


def create_app(host: Host, metrics, model_name: str, max_upload_bytes: int, queue_depth: int,
               queue_timeout_s: float, on_startup=None, on_shutdown=None) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        app.state.admission = Admission(queue_depth, queue_timeout_s, metrics, host.max_batch)
        if on_startup:
            on_startup(asyncio.get_running_loop())
        yield
        if on_shutdown:
            await run_in_threadpool(on_shutdown)

    app = FastAPI(title="nxdi_voxtral", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        if isinstance(exc, ApiError):
            return error_response(exc.status_code, exc.message, exc.code, exc.param, exc.headers)
        codes = {404: "not_found", 405: "method_not_allowed", 400: "invalid_request"}
        return error_response(exc.status_code, str(exc.detail), codes.get(exc.status_code), None, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = str(first["loc"][-1]) if first.get("loc") else None
        status = 400 if first.get("type") == "missing" else 422
        return error_response(status, f"{param}: {first['msg']}", "invalid_value" if status == 422 else
                              "missing_field", param)

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")

    @app.get("/health/live")
    async def live():
        if host.state == "failed":
            return error_response(503, "the model could not be reopened; restart the process", "failed")
        return {"status": "alive", "state": host.state}

    @app.get("/health/ready")
    async def ready():
        if not host.ready:
            return error_response(503, f"not ready: {host.state}", "not_ready", headers={"Retry-After": "2"})
        return {"status": "ready", "version": host.live.version.id}

    @app.get("/health")
    async def health():
        loaded = host.live
        body = {"state": host.state, "ready": host.ready, "model": model_name,
                "version": loaded.version.id if loaded else None, "path": loaded.version.path if loaded else None,
                "rank_pids": loaded.rank_pids() if loaded else [], "last_swap": host.last_swap,
                "queue_waiting": app.state.admission.waiting, "batch": host.batch_status()}
        return JSONResponse(body, status_code=200 if host.ready else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        loaded = host.live
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "nxdi_voxtral",
            "root": loaded.version.path if loaded else None, "version": loaded.version.id if loaded else None}]}

    @app.post(TRANSCRIBE)
    async def transcriptions(
        request: Request,
        file: UploadFile = File(...),
        model: str | None = Form(None),
        language: str | None = Form(None),
        prompt: str | None = Form(None),
        response_format: Literal["json", "text", "verbose_json"] = Form("json"),
        temperature: float = Form(0.0),
        stream: bool = Form(False),
        stream_include_usage: bool = Form(False),
        max_completion_tokens: int | None = Form(None, ge=1),
    ):
        if model not in (None, "", model_name):
            raise ApiError(404, f"model {model!r} is not served here; this server serves {model_name!r}",
                           "model_not_found", "model")
        if temperature != 0.0:
            raise ApiError(422, f"temperature {temperature:g} is not supported: this server decodes greedily "
                           f"(temperature 0) so that speculation keeps the exact output", "unsupported_value",
                           "temperature")
        if prompt:
            raise ApiError(422, "prompt is not supported by Voxtral transcription", "unsupported_value", "prompt")
        if language:
            try:
                language = str(LANGUAGE.validate_python(language))
            except ValidationError:
                raise ApiError(400, f"unknown language {language!r}: expected an ISO-639-1 code such as 'en'",
                               "invalid_language", "language") from None
        ctype = (file.content_type or "").lower()
        if ctype and not ctype.startswith(AUDIO_TYPES):
            raise ApiError(415, f"unsupported media type {ctype!r} for 'file': send audio (wav, flac, ogg, mp3)",
                           "unsupported_media_type", "file")
        if not host.ready:
            metrics.rejected.labels("not_ready").inc()
            raise busy(f"not ready: {host.state}", "not_ready", 2)
        data = await file.read()
        seconds = await run_in_threadpool(upload_seconds, data)
        if seconds > host.max_audio_s:
            raise ApiError(413, f"audio of {seconds:.1f} s is longer than the {host.max_audio_s:g} s this server "
                           f"transcribes (--max-audio-s)", "audio_too_long", "file")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(audio=data, audio_s=seconds, language=language or None,
                  max_new_tokens=max_completion_tokens, stream=stream,
                  emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        admission: Admission = app.state.admission
        gone = asyncio.create_task(client_gone(request))
        try:
            await unless_gone(admission.acquire(), gone, job)
            future = host.submit(job)
            future.add_done_callback(lambda f: loop.call_soon_threadsafe(admission.release))
            if stream:
                future.add_done_callback(lambda f: loop.call_soon_threadsafe(events.put_nowait, ("end", f)))
                first = await unless_gone(events.get(), gone, job)
                if first[0] == "end":
                    raise job_error(first[1].exception())
                return stream_response(first[1], job, events, model_name, stream_include_usage)
            try:
                result = await unless_gone(asyncio.wrap_future(future), gone, job)
            except (ClientGone, ApiError):
                raise
            except Exception as e:  # noqa: BLE001 - the device job's failure, mapped to its status
                raise job_error(e) from None
        except ClientGone:
            return error_response(499, "client closed the request", "cancelled")
        finally:
            gone.cancel()  # streaming: StreamingResponse watches the disconnect from here on
        return render(result, response_format, language, model_name)

    return app


class ClientGone(Exception):
    pass


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(awaitable, gone: asyncio.Task, job: Job):
    """Await `awaitable` unless the client leaves first: then stop its generation (its sequence leaves the batch at
    the next step; the admission place is released when the job actually ends) and raise ClientGone."""
    task = asyncio.ensure_future(awaitable)
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    job.cancel.set()
    raise ClientGone()


def job_error(exc: BaseException) -> ApiError:
    """Exceptions from the device job -> the client's error."""
    if isinstance(exc, AudioTooLongError):
        return ApiError(413, str(exc), "audio_too_long", "file")
    if isinstance(exc, AudioError):
        return ApiError(400, str(exc), "invalid_audio", "file")
    if isinstance(exc, ConfigError):
        return ApiError(400, str(exc), "invalid_request", None)
    if isinstance(exc, WorkerDied):
        return busy(str(exc), "worker_died", 5)
    if isinstance(exc, NotServing):
        return busy(str(exc), "not_ready", 2)
    if isinstance(exc, RequestCancelled):
        return ApiError(499, "client closed the request", "cancelled")
    log.error("request failed: %s: %s", type(exc).__name__, exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")


def version_headers(version) -> dict:
    return {"x-voxtral-version": version.id}


def render(result, response_format: str, language: str | None, model_name: str) -> Response:
    headers = version_headers(result.version)
    if response_format == "text":
        return PlainTextResponse(result.text, headers=headers)
    usage = {"type": "duration", "seconds": round(result.duration_s, 3)}
    if response_format == "json":
        return JSONResponse({"text": result.text, "usage": usage}, headers=headers)
    return JSONResponse({
        "task": "transcribe", "language": language, "duration": result.duration_s, "text": result.text,
        "segments": [{"id": i, "start": s.start, "end": s.end, "text": s.text, "tokens": s.token_ids}
                     for i, s in enumerate(result.segments)],
        "usage": usage, "model": model_name, "model_version": result.version.id,
        "tokens": len(result.token_ids), "finish_reason": result.finish_reason,
        "timings": {k: round(v, 6) if isinstance(v, float) else v for k, v in result.timings.items()},
        "speculation": result.stats}, headers=headers)


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def stream_response(version, job: Job, events: asyncio.Queue, model_name: str, include_usage: bool) -> Response:
    """vLLM's `transcription.chunk` events: text deltas as tokens are accepted, a last chunk with finish_reason,
    optional usage, `data: [DONE]`. Errors before the first token are plain JSON errors with their status (the
    caller waited for the job's start); one after it arrives as `data: {"error": ...}` before [DONE]."""
    rid, created = f"trsc-{uuid.uuid4().hex}", int(time.time())

    def chunk(content: str | None, finish: str | None = None, usage=None, choices=True) -> str:
        body = {"id": rid, "object": "transcription.chunk", "created": created, "model": model_name,
                "choices": [{"delta": {"content": content}, "finish_reason": finish, "stop_reason": None}]
                if choices else []}
        if usage is not None:
            body["usage"] = usage
        return sse(body)

    async def body():
        try:
            while True:
                kind, payload = await events.get()
                if kind == "delta":
                    yield chunk(payload)
                    continue
                exc = payload.exception()
                if exc is not None:
                    err = job_error(exc)
                    yield sse({"error": {"message": err.message, "type": "server_error" if err.status_code >= 500
                                         else "invalid_request_error", "param": err.param, "code": err.code}})
                else:
                    r = payload.result()
                    yield chunk("", r.finish_reason)
                    if include_usage:
                        n = len(r.token_ids)
                        yield chunk(None, usage={"prompt_tokens": r.prompt_tokens, "completion_tokens": n,
                                                 "total_tokens": r.prompt_tokens + n}, choices=False)
                yield "data: [DONE]\n\n"
                return
        finally:
            job.cancel.set()  # no-op when finished; stops generation when the client left mid-stream

    return StreamingResponse(body(), media_type="text/event-stream", headers={
        **version_headers(version), "Cache-Control": "no-cache"})

