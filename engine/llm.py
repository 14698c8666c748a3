"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``, batched through the same engine core."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.inputs import PromptType, as_prompt_list, fan_out
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

class LLM:
    """Runs many prompts to completion with continuous batching. Engine options are keyword arguments named as
    in ``EngineConfig`` (``max_num_seqs``, ``kv_cache_memory``, ...)."""

    def __init__(self, model: str | None = None, **engine_args: object) -> None:
        self.engine = EngineCore(EngineConfig.from_kwargs(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompts = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        processor = OutputProcessor(self.tokenizer)
        results: list[RequestOutput] = []
        children: dict[str, tuple[RequestOutput, int]] = {}
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                result = RequestOutput(str(self._next_id), prompt if isinstance(prompt, str) else None, token_ids, None)
                self._next_id += 1
                results.append(result)
                for sample in fan_out(result.request_id, 1, params):
                    self.engine.add_request(sample.request_id, token_ids, sample.params)
                    processor.add_request(sample.request_id, sample.index, token_ids, sample.params)
                    children[sample.request_id] = (result, sample.index)
            self._run(processor)
        except BaseException:
            self.engine.abort_requests(list(children))
            raise
        for child_id, (result, _) in children.items():
            state = processor.pop(child_id)
            result.outputs.append(state.to_completion())
            if state.prompt_logprobs is not None:
                result.prompt_logprobs = state.prompt_logprobs
            result.num_cached_tokens += state.num_cached_tokens
        for result in results:
            result.outputs.sort(key=lambda c: c.index)
            result.finished = True
        return results

    def embed(self, prompts: PromptType | Sequence[PromptType]) -> list[list[float]]:
        """An embedding model's vector for each prompt (text or token ids), batched as the server batches them."""
        if self.engine.pooling is None:
            raise ValueError("this model generates; embed() needs an embedding model (or runner='pooling')")
        prompts = as_prompt_list(prompts)
        processor = OutputProcessor(self.tokenizer)
        ids = []
        try:
            for prompt in prompts:
                token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                ids.append(str(self._next_id))
                self._next_id += 1
                self.engine.add_request(ids[-1], token_ids, SamplingParams(max_tokens=1))
                processor.add_request(ids[-1], 0, token_ids, SamplingParams(max_tokens=1))
            self._run(processor)
        except BaseException:
            self.engine.abort_requests(ids)
            raise
        return [processor.pop(i).pooled for i in ids]

    def _run(self, processor: OutputProcessor) -> None:
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.error is not None:
                    raise ValueError(output.error)
                _, stopped_by_string = processor.process(output)
                if stopped_by_string:
                    self.engine.abort_requests([output.request_id])

