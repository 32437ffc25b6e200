"""``n > 1``: one parent request fanned out into ``n`` child requests, outputs folded back.

Children share the prompt, so with the prefix cache on they share its KV blocks. With a seed,
child ``i`` samples with ``seed + i`` (as vLLM's ``ParentRequest`` does): child 0 gives what
``n=1`` with the same seed gives, and a seeded request is reproducible whatever else runs.
Only child 0 computes prompt logprobs.
"""

from __future__ import annotations

from pyxllm.outputs import CompletionOutput, RequestOutput
from pyxllm.sampling_params import SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    """The id of the parent's ``index``-th child (vLLM's ``f"{index}_{parent_id}"``)."""
    return f"{index}_{parent_id}"


class ParentRequest:
    """Holds the latest output of each of a request's ``n`` children.

    Attributes:
        child_ids: the children's request ids, in index order.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.params = params
        self.child_ids = [child_request_id(request_id, i) for i in range(params.n)]
        self.outputs = [CompletionOutput(index=i, text="", token_ids=[]) for i in range(params.n)]
        self.finished = [False] * params.n
        self.prompt_logprobs = self.prompt_logprobs_tensor = None
        self.num_cached_tokens: int | None = None

    def child_params(self, index: int) -> SamplingParams:
        """The sampling parameters of child ``index``: ``n=1``, ``seed + index``, and prompt
        logprobs for child 0 only."""
        params = self.params
        return params.replace(
            n=1,
            seed=None if params.seed is None else (params.seed + index) % 2**64,
            prompt_logprobs=params.prompt_logprobs if index == 0 else None,
        )

    def update(self, child: RequestOutput) -> None:
        """Take a child's latest output (its one completion keeps its ``index``)."""
        completion = child.outputs[0]
        self.outputs[completion.index] = completion
        self.finished[completion.index] = child.finished
        if child.prompt_logprobs is not None:
            self.prompt_logprobs = child.prompt_logprobs
        if child.prompt_logprobs_tensor is not None:
            self.prompt_logprobs_tensor = child.prompt_logprobs_tensor
        if completion.index == 0:  # the prompt is counted once: as the first sample's
            self.num_cached_tokens = child.num_cached_tokens

    def output(self) -> RequestOutput:
        """The parent's output: every child's latest completion, finished when all are."""
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            list(self.outputs),
            all(self.finished),
            self.prompt_logprobs,
            self.prompt_logprobs_tensor,
            self.num_cached_tokens,
        )


def fold_children(
    outputs: list[RequestOutput],
    parents: dict[str, ParentRequest],
    parent_of: dict[str, ParentRequest],
) -> list[RequestOutput]:
    """Replace a step's child outputs by one output per parent; a finished child leaves
    ``parent_of``, a finished parent leaves ``parents``."""
    folded, updated = [], {}
    for output in outputs:
        parent = parent_of.get(output.request_id)
        if parent is None:
            folded.append(output)
            continue
        parent.update(output)
        if output.finished:
            del parent_of[output.request_id]
        updated[parent.request_id] = parent
    for parent in updated.values():
        output = parent.output()
        if output.finished:
            del parents[parent.request_id]
        folded.append(output)
    return folded
