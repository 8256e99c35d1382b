"""`sglbus.Engine`: the offline engine. The same gateway, scheduler and detokenizer code as the served
system, wired through the in-process transport on a private event loop thread.

    with sglbus.Engine() as engine:
        engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 16})
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import torch

from services.detokenizer.service import DetokenizerService
from services.gateway.image_inputs import ImageInputs
from services.gateway.request_manager import RequestManager
from services.scheduler.model_runner import ModelRunner
from services.scheduler.scheduler import Scheduler
from services.scheduler.service import SchedulerService
from shared.config import EngineConfig
from shared.gc_freeze import freeze_startup_objects, unfreeze
from shared.media import MediaLimits
from shared.model_files import resolve_model_folder
from shared.tokenizer import load_tokenizer
from shared.transport import InProcessTransport

log = logging.getLogger(__name__)
_END = object()


class Engine:
    def __init__(self, model_path: str | None = None, **options: Any) -> None:
        self.config = EngineConfig.from_env(model_path=model_path, **options)
        self.model_folder = resolve_model_folder(self.config.model_path, self.config.load_format != "dummy")
        self.tokenizer = load_tokenizer(self.config.tokenizer_path or self.model_folder)
        runner = ModelRunner(self.config, self.model_folder)
        self.model_config = runner.model_config
        # a vision-language model's images (image_data: base64, data URLs, bytes; no file paths)
        images = ImageInputs.from_folder(self.model_folder, runner.model_config.vocab_size, MediaLimits())
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglbus-engine", daemon=True)
        self._thread.start()
        self._closed = False

        async def start() -> None:
            cfg = self.config
            self.transport = InProcessTransport()
            self.scheduler_service = SchedulerService(cfg, self.transport, runner)
            self.detokenizer = DetokenizerService(
                self.tokenizer, self.transport, cfg.subject_prefix, cfg.worker_id
            )
            self.requests = RequestManager(
                self.tokenizer,
                self.transport,
                cfg.subject_prefix,
                runner.model_config.vocab_size,
                runner.context_len,
                images=images,
            )
            await self.scheduler_service.start()
            await self.detokenizer.start()
            await self.requests.start()

        self._run(start())
        freeze_startup_objects()  # no full-collection stalls of the step loop (shared/gc_freeze.py)

    # -- public API ---------------------------------------------------------------------------
    def generate(
        self,
        text: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_logprob: bool | list[bool] | None = None,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        return_text_in_logprobs: bool | None = None,
        return_flat_raw_top_logprobs: bool | None = None,
        return_flat_raw_top_logprobs_b64: bool | None = None,
        return_output_top_logprobs_b64: bool | None = None,
        image_data: Any = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """SGLang's `/generate` response: a dict, a list of dicts for batch input or n > 1, or with
        stream=True an iterator of chunks (cumulative text and logprobs; batch chunks carry `index`).
        The logprob arguments and image_data (a vision-language model's images: encoded bytes, base64
        or data URLs; per prompt for a batch) are `/generate`'s fields of the same names."""
        obj = {"text": text, "input_ids": input_ids, "image_data": image_data,
               "sampling_params": sampling_params, "rid": rid,
               "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
               "top_logprobs_num": top_logprobs_num, "token_ids_logprob": token_ids_logprob,
               "return_text_in_logprobs": return_text_in_logprobs,
               "return_flat_raw_top_logprobs": return_flat_raw_top_logprobs,
               "return_flat_raw_top_logprobs_b64": return_flat_raw_top_logprobs_b64,
               "return_output_top_logprobs_b64": return_output_top_logprobs_b64}  # fmt: skip
        if stream:
            return self._stream(obj)
        return self._run(self.requests.generate(obj))

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing done) while requests run."""
        return self._on_scheduler(Scheduler.flush_cache)

    def get_stats(self) -> dict[str, Any]:
        """Scheduler counters (prompt/cached/generated tokens, steps, time in forward) and pool sizes."""

        def read(s: Scheduler) -> dict[str, Any]:
            return {
                **s.stats,
                "max_total_tokens": s.kv.size,
                "free_tokens": s.kv.free_count,
                "cached_tokens_in_tree": s.tree.total_size(),
                "running": len(s.running),
                "waiting": len(s.waiting),
            }

        return self._on_scheduler(read)

    def check_integrity(self) -> None:
        """Raise AssertionError if any KV slot leaked (free + cached + in use != pool)."""
        self._on_scheduler(Scheduler.check_integrity)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            await self.requests.stop()
            await self.detokenizer.stop()
            await self.scheduler_service.stop()
            await self.transport.close()

        self._run(stop())
        self.scheduler_service.runner.close()  # its tensor-parallel ranks
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        # the model, its KV pool and CUDA graphs go now, not when this object does: an Engine made
        # next (`with Engine(...)` in a loop) would otherwise find the GPU full
        del self.scheduler_service
        unfreeze()  # what start-up froze is collectable again (the model's cycles, if any)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- plumbing -----------------------------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _on_scheduler(self, fn: Callable[[Scheduler], Any]) -> Any:
        """Run fn(scheduler) on the scheduler thread between two steps."""

        async def call() -> Any:
            return await self.scheduler_service.call(fn)

        return self._run(call())

    def _stream(self, obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
        chunks: queue.Queue[Any] = queue.Queue()

        async def pump() -> None:
            try:
                async for chunk in self.requests.generate_stream(obj):
                    chunks.put(chunk)
            except Exception as e:  # raised in the caller's thread
                chunks.put(e)
            finally:
                chunks.put(_END)

        task = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := chunks.get()) is not _END:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            task.cancel()
