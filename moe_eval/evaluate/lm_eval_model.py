"""lm-eval's `local-completions` model, telling moe-eval about every answer as it arrives.

lm-eval reports nothing until the whole task is done; a CI log or a terminal would show no
progress for minutes. `ProgressCompletionsAPI` is the same client (same payloads, retries and
parsing) with a hook after each completed request that passes the prompts and the generated
texts to a listener (moe_eval.core.status.StatusWriter.answered). Usage:

    set_listener(status.answered)
    lm_eval.simple_evaluate(model=MODEL_NAME, ...)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.openai_completions import LocalCompletionsAPI

MODEL_NAME = "moe-eval-completions"
Listener = Callable[[str, str], None]
_listener: Listener | None = None


def set_listener(listener: Listener | None) -> None:
    global _listener
    _listener = listener


def _notify(prompts: Any, texts: Any) -> None:
    if _listener is None or texts is None:
        return
    if isinstance(prompts, str):
        prompts = [prompts]
    for prompt, text in zip(prompts, texts, strict=False):
        if isinstance(prompt, str):
            _listener(prompt, text if isinstance(text, str) else "")


@register_model(MODEL_NAME)
class ProgressCompletionsAPI(LocalCompletionsAPI):
    async def amodel_call(
        self, session: Any, sem: Any, messages: Any, *, generate: bool = True, **kwargs: Any
    ) -> Any:
        answers = await super().amodel_call(session, sem, messages, generate=generate, **kwargs)
        if generate:
            _notify(messages, answers)
        return answers

    def model_call(
        self, messages: Any, *, generate: bool = True, gen_kwargs: dict | None = None, **kwargs: Any
    ) -> Any:
        outputs = super().model_call(messages, generate=generate, gen_kwargs=gen_kwargs, **kwargs)
        if generate and outputs is not None:
            _notify(messages, self.parse_generations(outputs=outputs))
        return outputs
