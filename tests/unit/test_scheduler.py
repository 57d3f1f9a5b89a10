"""Continuous-batching scheduler driven step by step by a fake worker that checks the KV cache."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hybridllm.config import CacheConfig, SchedulerConfig
from hybridllm.engine.kv_cache_manager import FULL_ATTENTION
from hybridllm.engine.request import Request, RequestStatus
from hybridllm.engine.scheduler import Scheduler
from hybridllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from hybridllm.sample.draft_acceptance import accepted_length
from hybridllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
EOS = 2


def history_token(req_id: str, tokens: list[int]) -> int:
    """Next token as a function of the whole history: any lost/duplicated token shows up."""
    return 10 + hash(tuple(tokens)) % 90


class FakeWorker:
    """Mirrors what a worker keeps between steps and simulates the paged KV cache.

    Each slot stores a hash of the whole prefix up to its position (what real KV depends
    on); before sampling, every position of the sequence is read back through the block
    table, so a wrong prefix hit, an overwritten shared block or a lost token fails.
    """

    def __init__(
        self,
        block_size: int,
        token_fn: Callable[[str, list[int]], int] = history_token,
        windows: tuple[int | None, ...] = (None,),
    ):
        self.block_size = block_size
        self.token_fn = token_fn
        self.windows = windows  # per KV cache group: None (full) or its sliding window
        self.kv: dict[tuple[int, int], int] = {}  # (group, slot) -> prefix hash
        self.tokens: dict[str, list[int]] = {}
        self.prefix_hashes: dict[str, list[int]] = {}
        self.block_tables: dict[str, list[list[int]]] = {}  # per group
        self.num_computed: dict[str, int] = {}

    def _add_tokens(self, req_id: str, token_ids: list[int]) -> None:
        hashes = self.prefix_hashes[req_id]
        for token_id in token_ids:
            self.tokens[req_id].append(token_id)
            hashes.append(hash((hashes[-1] if hashes else None, token_id)))

    def _slot(self, req_id: str, pos: int, group: int = 0) -> tuple[int, int]:
        block = self.block_tables[req_id][group][pos // self.block_size]
        return group, block * self.block_size + pos % self.block_size

    def _check_kv(
        self, req_id: str, group: int, first: int, end: int, hashes: list[int] | None = None
    ) -> None:
        hashes = self.prefix_hashes[req_id] if hashes is None else hashes
        for pos in range(first, end):
            assert self.kv[self._slot(req_id, pos, group)] == hashes[pos], (
                f"{req_id}: KV of group {group} at position {pos} is not this sequence's"
            )

    def _hashes_with(self, req_id: str, drafts: list[int]) -> list[int]:
        """Prefix hashes of the request's tokens followed by `drafts` (what their KV holds)."""
        hashes = list(self.prefix_hashes[req_id])
        for token_id in drafts:
            hashes.append(hash((hashes[-1] if hashes else None, token_id)))
        return hashes

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in output.finished_req_ids:
            for state in (self.tokens, self.prefix_hashes, self.block_tables, self.num_computed):
                state.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            assert new.req_id not in self.tokens, "new request the worker already holds"
            self.tokens[new.req_id], self.prefix_hashes[new.req_id] = [], []
            self._add_tokens(new.req_id, new.prompt_token_ids + new.output_token_ids)
            assert len(new.block_ids) == len(self.windows)
            self.block_tables[new.req_id] = [list(ids) for ids in new.block_ids]
            self.num_computed[new.req_id] = new.num_computed_tokens
        for cached in output.scheduled_cached_reqs:
            assert self.num_computed[cached.req_id] == cached.num_computed_tokens
            assert cached.spec_token_ids == output.scheduled_spec_decode_tokens.get(
                cached.req_id, []
            )
            self._add_tokens(cached.req_id, cached.new_token_ids)
            for table, ids in zip(self.block_tables[cached.req_id], cached.new_block_ids):
                table += ids
        scheduled = output.num_scheduled_tokens
        drafts_of = output.scheduled_spec_decode_tokens
        assert sum(scheduled.values()) == output.total_num_scheduled_tokens
        assert len(output.scheduled_new_reqs) + len(output.scheduled_cached_reqs) == len(scheduled)
        hashes = {r: self._hashes_with(r, drafts_of.get(r, [])) for r in scheduled}
        # Like a real forward pass: every KV write of the step lands before any read.
        for req_id, num_tokens in scheduled.items():
            start = self.num_computed[req_id]
            assert num_tokens > 0 and start + num_tokens <= len(hashes[req_id])
            for pos in range(start, start + num_tokens):
                for group in range(len(self.windows)):
                    self.kv[self._slot(req_id, pos, group)] = hashes[req_id][pos]
            self.num_computed[req_id] = start + num_tokens
        for req_id, num_tokens in scheduled.items():
            # a sliding group's first query of the step reads from start - window + 1
            start = self.num_computed[req_id] - num_tokens
            for group, window in enumerate(self.windows):
                if window is not None:
                    self._check_kv(
                        req_id,
                        group,
                        max(0, start - window + 1),
                        start + num_tokens,
                        hashes[req_id],
                    )
        runner_output = ModelRunnerOutput()
        for req_id in scheduled:
            tokens = self.tokens[req_id]
            drafts = drafts_of.get(req_id, [])
            if self.num_computed[req_id] - len(drafts) < len(tokens):
                continue  # a prompt chunk that is not the last: nothing to sample
            end = len(tokens) + len(drafts)
            for group, window in enumerate(self.windows):
                # the last query (position end - 1) sees keys in (end - 1 - window, end - 1]
                first = 0 if window is None else max(0, end - window)
                self._check_kv(req_id, group, first, end, hashes[req_id])
            sampled = [self.token_fn(req_id, tokens + drafts[:j]) for j in range(len(drafts) + 1)]
            kept = accepted_length(drafts, sampled)
            self.num_computed[req_id] -= len(drafts) - kept
            runner_output.req_ids.append(req_id)
            runner_output.sampled_token_ids.append(sampled[: kept + 1])
            runner_output.logprobs.append(None)
        return runner_output


def make_scheduler(
    num_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 256,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    kv_cache_groups=FULL_ATTENTION,
    num_lookahead_tokens: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
        ),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
        kv_cache_groups=kv_cache_groups,
        num_lookahead_tokens=num_lookahead_tokens,
    )


def make_request(req_id: str, prompt, eos: int | None = EOS, **params) -> Request:
    params.setdefault("ignore_eos", eos is None)
    return Request(req_id, list(prompt), SamplingParams(**params), eos_token_id=eos)


def step(scheduler: Scheduler, worker: FakeWorker) -> tuple[SchedulerOutput, list[Request]]:
    output = scheduler.schedule()
    config = scheduler.scheduler_config
    assert output.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(output.num_scheduled_tokens) <= config.max_num_seqs
    assert scheduler.num_running <= config.max_num_seqs
    return output, scheduler.update_from_output(output, worker.execute(output))


def run_to_completion(scheduler: Scheduler, worker: FakeWorker, max_steps: int = 1000) -> list:
    history = []
    while scheduler.has_unfinished_requests():
        history.append(step(scheduler, worker))
        assert len(history) < max_steps, "scheduler made no progress"
    assert_no_leaks(scheduler)
    return history


def assert_no_leaks(scheduler: Scheduler) -> None:
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    for manager in scheduler.block_manager.managers:
        null = getattr(manager, "null_block", None)
        assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks if b is not null)
        assert manager.req_to_blocks == {}
    assert scheduler.requests == {}


def test_budget_and_max_num_seqs_respected():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=3)
    requests = [make_request(f"r{i}", range(i, i + 5 + i), max_tokens=6) for i in range(7)]
    for request in requests:
        scheduler.add_request(request)
    history = run_to_completion(scheduler, FakeWorker(BLOCK_SIZE))
    assert max(len(out.num_scheduled_tokens) for out, _ in history) == 3
    assert max(out.total_num_scheduled_tokens for out, _ in history) == 16
    for request in requests:
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.num_output_tokens == 6


def test_chunked_prefill_splits_prompt_and_samples_only_at_the_end():
    scheduler = make_scheduler(max_num_batched_tokens=32)
    request = make_request("long", range(100), max_tokens=2)
    scheduler.add_request(request)
    worker = FakeWorker(BLOCK_SIZE)
    chunks, sampled = [], []
    for _ in range(5):
        output, updated = step(scheduler, worker)
        chunks.append(output.num_scheduled_tokens["long"])
        sampled.append([r.request_id for r in updated])
    assert chunks == [32, 32, 32, 4, 1]
    assert sampled == [[], [], [], ["long"], ["long"]]
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert_no_leaks(scheduler)


def test_running_decodes_share_the_budget_with_a_prefill_chunk():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    worker = FakeWorker(BLOCK_SIZE)
    scheduler.add_request(make_request("a", range(3), max_tokens=5))
    step(scheduler, worker)
    scheduler.add_request(make_request("b", range(20, 40), max_tokens=1))
    output, _ = step(scheduler, worker)
    assert output.num_scheduled_tokens == {"a": 1, "b": 7}  # decode first, rest to the prompt
    run_to_completion(scheduler, worker)


def test_without_chunked_prefill_prompt_is_all_or_nothing():
    scheduler = make_scheduler(
        max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False
    )
    worker = FakeWorker(BLOCK_SIZE)
    scheduler.add_request(make_request("a", range(20), max_tokens=3))
    scheduler.add_request(make_request("b", range(50, 70), max_tokens=3))
    output, _ = step(scheduler, worker)
    assert output.num_scheduled_tokens == {"a": 20}  # b does not fit in the 12 left
    output, _ = step(scheduler, worker)
    assert output.num_scheduled_tokens == {"a": 1, "b": 20}
    run_to_completion(scheduler, worker)


def test_fcfs_admission_order():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    for name in "abcd":
        scheduler.add_request(make_request(name, range(10), max_tokens=1, prompt_logprobs=0))
    admitted = []
    history = run_to_completion(scheduler, FakeWorker(BLOCK_SIZE))
    for output, _ in history:
        admitted += [new.req_id for new in output.scheduled_new_reqs]
    assert admitted == list("abcd")
    finished = [r.request_id for _, updated in history for r in updated if r.is_finished()]
    assert finished == list("abcd")


def run_outputs(num_blocks: int, **kwargs) -> tuple[dict[str, list[int]], Scheduler, list[str]]:
    """Run 3 requests to completion; also return the request ids in order of preemption."""
    scheduler = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=32, **kwargs)
    requests = [make_request(f"r{i}", range(10 * i, 10 * i + 6), max_tokens=20) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    worker = FakeWorker(BLOCK_SIZE)
    preempted, resumed = [], []
    while scheduler.has_unfinished_requests():
        before = {r.request_id: r.num_preemptions for r in requests}
        output, _ = step(scheduler, worker)
        newly = [r.request_id for r in requests if r.num_preemptions > before[r.request_id]]
        assert set(newly) <= output.finished_req_ids  # workers drop a preempted request
        preempted += newly
        # A resumed request is new to the workers but brings its outputs for the recompute.
        resumed += [new.req_id for new in output.scheduled_new_reqs if new.output_token_ids]
    assert_no_leaks(scheduler)
    assert sorted(preempted) == sorted(resumed)
    return {r.request_id: r.output_token_ids for r in requests}, scheduler, preempted


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_evicts_latest_arrival_and_it_resumes(enable_prefix_caching):
    expected, roomy, _ = run_outputs(num_blocks=64, enable_prefix_caching=enable_prefix_caching)
    assert roomy.num_preemptions == 0
    # 3 requests growing to 26 tokens need 21 blocks; 14 forces preemption.
    outputs, scheduler, preempted = run_outputs(
        num_blocks=14, enable_prefix_caching=enable_prefix_caching
    )
    assert scheduler.num_preemptions == len(preempted) > 0
    assert preempted[0] == "r2"  # the latest arrival goes first
    assert outputs == expected  # recompute reproduced every token
    assert all(len(tokens) == 20 for tokens in outputs.values())


def test_preempted_request_goes_back_to_queue_head():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=32)
    worker = FakeWorker(BLOCK_SIZE)
    first = make_request("first", range(8), max_tokens=8)
    second = make_request("second", range(20, 28), max_tokens=8)
    third = make_request("third", range(40, 44), max_tokens=1)
    for request in (first, second):
        scheduler.add_request(request)
    step(scheduler, worker)  # both prompts: 4 blocks, pool full
    scheduler.add_request(third)
    output, _ = step(scheduler, worker)  # first needs a 3rd block: second is preempted
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert output.finished_req_ids == {"second"} and "second" not in output.num_scheduled_tokens
    assert [r.request_id for r in scheduler.waiting] == ["second", "third"]
    assert second.num_output_tokens == 1  # kept for the recompute
    run_to_completion(scheduler, worker)
    assert first.num_output_tokens == second.num_output_tokens == 8
    assert third.status == RequestStatus.FINISHED_LENGTH


def test_prefix_hit_in_scheduler_reuses_computed_kv():
    scheduler = make_scheduler()
    worker = FakeWorker(BLOCK_SIZE)
    prompt = list(range(30, 43))  # 13 tokens: 3 full blocks
    first = make_request("a", prompt, max_tokens=3)
    scheduler.add_request(first)
    run_to_completion(scheduler, worker)
    second = make_request("b", prompt, max_tokens=3)
    scheduler.add_request(second)
    output, _ = step(scheduler, worker)
    assert output.scheduled_new_reqs[0].num_computed_tokens == 12
    assert output.num_scheduled_tokens == {"b": 1}
    assert second.num_cached_tokens == 12
    run_to_completion(scheduler, worker)  # the worker checked the reused KV at every step
    assert second.output_token_ids == first.output_token_ids
    assert scheduler.prefix_cache_hit_tokens == 12


def fixed_tokens(*tokens: int) -> Callable[[str, list[int]], int]:
    """Token function emitting `tokens` in order, then 50 forever."""

    def token_fn(req_id: str, history: list[int]) -> int:
        return tokens[len(history) - 4] if len(history) - 4 < len(tokens) else 50

    return token_fn


@pytest.mark.parametrize(
    ("params", "sampled", "status", "num_out", "stop_reason"),
    [
        ({"max_tokens": 3}, (7, 8, 9, 10), RequestStatus.FINISHED_LENGTH, 3, None),
        ({"max_tokens": 9}, (7, EOS, 9), RequestStatus.FINISHED_STOPPED, 2, None),
        (
            {"max_tokens": 4, "ignore_eos": True},
            (7, EOS, 9),
            RequestStatus.FINISHED_LENGTH,
            4,
            None,
        ),
        (
            {"max_tokens": 9, "min_tokens": 3},
            (EOS, EOS, EOS),
            RequestStatus.FINISHED_STOPPED,
            3,
            None,
        ),
        ({"max_tokens": 9, "stop_token_ids": [8]}, (7, 8, 9), RequestStatus.FINISHED_STOPPED, 2, 8),
        ({"max_tokens": 2}, (7, EOS), RequestStatus.FINISHED_STOPPED, 2, None),
        ({"max_tokens": None}, (7,), RequestStatus.FINISHED_LENGTH, 12, None),  # max_model_len
    ],
)
def test_stop_conditions(params, sampled, status, num_out, stop_reason):
    scheduler = make_scheduler(max_model_len=16)
    request = Request("r", [1, 3, 5, 7], SamplingParams(**params), eos_token_id=EOS)
    scheduler.add_request(request)
    run_to_completion(scheduler, FakeWorker(BLOCK_SIZE, fixed_tokens(*sampled)))
    assert request.status == status
    assert request.num_output_tokens == num_out
    assert request.stop_reason == stop_reason
    assert request.output_token_ids == [*sampled, *[50] * 20][:num_out]


def test_length_is_capped_by_pool_capacity():
    scheduler = make_scheduler(num_blocks=3, max_model_len=256)  # 12 tokens of KV
    request = make_request("r", range(5), max_tokens=100)
    scheduler.add_request(request)
    run_to_completion(scheduler, FakeWorker(BLOCK_SIZE))
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.num_tokens == 13  # the 12th token's KV still fit, so it sampled once more


def test_abort_frees_blocks_of_running_and_waiting():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=2)
    worker = FakeWorker(BLOCK_SIZE)
    requests = [make_request(f"r{i}", range(10), max_tokens=50) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    step(scheduler, worker)
    step(scheduler, worker)
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1
    assert scheduler.block_manager.num_free_blocks < scheduler.block_manager.num_blocks
    scheduler.abort_requests(["r0", "r2", "unknown"])
    assert [r.status for r in requests] == [
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.RUNNING,
        RequestStatus.FINISHED_ABORTED,
    ]
    assert requests[0].get_finish_reason() == "abort"
    assert scheduler.num_running == 1 and scheduler.num_waiting == 0
    output, _ = step(scheduler, worker)
    assert output.finished_req_ids == {"r0", "r2"} and list(output.num_scheduled_tokens) == ["r1"]
    scheduler.abort_requests("r1")
    assert not scheduler.has_unfinished_requests()
    assert_no_leaks(scheduler)


def test_finish_requests_for_stop_strings():
    scheduler = make_scheduler()
    worker = FakeWorker(BLOCK_SIZE)
    request = make_request("r", range(6), max_tokens=50)
    scheduler.add_request(request)
    step(scheduler, worker)
    scheduler.finish_requests(["r"], RequestStatus.FINISHED_STOPPED, stop_reason="###")
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == "###"
    assert_no_leaks(scheduler)
    with pytest.raises(ValueError, match="FINISHED_"):
        scheduler.finish_requests(["r"], RequestStatus.RUNNING)


def test_prompt_larger_than_pool_finishes_with_error():
    scheduler = make_scheduler(num_blocks=4)
    too_big = make_request("big", range(17))
    fits = make_request("ok", range(16), max_tokens=1)
    scheduler.add_request(too_big)
    scheduler.add_request(fits)
    assert too_big.status == RequestStatus.FINISHED_ERROR and "4 blocks" in too_big.error
    history = run_to_completion(scheduler, FakeWorker(BLOCK_SIZE))
    assert history[0][1][0] is too_big  # reported by the first update_from_output
    assert fits.status == RequestStatus.FINISHED_LENGTH
    # An empty step with no runner output still reports it.
    scheduler.add_request(make_request("big2", range(40)))
    assert scheduler.has_unfinished_requests()
    output = scheduler.schedule()
    assert output.is_empty
    assert [r.request_id for r in scheduler.update_from_output(output, None)] == ["big2"]
    assert not scheduler.has_unfinished_requests()


def test_in_flight_requests_are_not_scheduled_twice():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    worker = FakeWorker(BLOCK_SIZE)
    scheduler.add_request(make_request("a", range(20), max_tokens=2))
    first = scheduler.schedule()
    scheduler.add_request(make_request("b", range(30, 34), max_tokens=2))
    second = scheduler.schedule()  # "a" is still in flight: only "b" runs
    assert first.num_scheduled_tokens == {"a": 8} and second.num_scheduled_tokens == {"b": 4}
    scheduler.abort_requests("b")  # aborted in flight: blocks freed once it reports back
    assert scheduler.block_manager.managers[0].req_to_blocks["b"]
    scheduler.update_from_output(first, worker.execute(first))
    scheduler.update_from_output(second, worker.execute(second))
    assert "b" not in scheduler.block_manager.managers[0].req_to_blocks
    run_to_completion(scheduler, worker)


def test_runner_output_must_match_the_schedule():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", range(20)))
    output = scheduler.schedule()
    bogus = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5]], logprobs=[None])
    with pytest.raises(RuntimeError, match="mid-prefill"):
        scheduler.update_from_output(output, bogus)


def test_duplicate_request_id_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(4)))
    with pytest.raises(ValueError, match="already scheduled"):
        scheduler.add_request(make_request("a", range(4)))


# ---- speculative decoding: drafts verified by the fake worker ----------------------------------


def draft_from(worker_token_fn, right: bool, k: int = 3):
    """A drafter for `run_with_drafts`: the next k true tokens (all accepted) or wrong ones."""

    def drafts(request: Request) -> list[int]:
        tokens = list(request.all_token_ids)
        out = []
        for _ in range(k):
            token = worker_token_fn(request.request_id, tokens)
            out.append(token if right else token + 1000)
            tokens.append(token)
        return out

    return drafts


def step_with_drafts(scheduler: Scheduler, worker: FakeWorker, drafter) -> tuple:
    for request in scheduler.running:
        if request.num_computed_tokens == request.num_tokens - 1:
            request.spec_token_ids = drafter(request)
    return step(scheduler, worker)


def spec_scheduler_pair(windows=(None,), **kwargs) -> tuple[Scheduler, Scheduler]:
    from hybridllm.engine.kv_cache_groups import KVCacheGroupSpec

    groups = tuple(KVCacheGroupSpec(w, ()) for w in windows)
    return make_scheduler(kv_cache_groups=groups, **kwargs), make_scheduler(
        kv_cache_groups=groups, **kwargs
    )


@pytest.mark.parametrize("windows", [(None,), (None, 6)])
def test_rejected_drafts_leave_the_kv_as_if_never_written(windows):
    # Every draft wrong: both schedulers advance one token a step, in lockstep. The fake worker
    # reads back every position a query sees, so a rejected draft's KV that was read, or a
    # slot not overwritten by the token that replaced the draft, fails; the prefix cache holds
    # the same blocks as plain decoding's, and a request holds at most one block more (the
    # slots of its last drafts, which its next tokens overwrite).
    plain, spec = spec_scheduler_pair(windows, num_blocks=40)
    workers = [FakeWorker(BLOCK_SIZE, windows=windows) for _ in range(2)]
    for scheduler in (plain, spec):
        for i in range(3):
            scheduler.add_request(make_request(f"r{i}", range(i, i + 7), eos=None, max_tokens=20))
    drafter = draft_from(history_token, right=False)
    while plain.has_unfinished_requests():
        _, plain_updated = step(plain, workers[0])
        _, spec_updated = step_with_drafts(spec, workers[1], drafter)
        assert [r.output_token_ids for r in plain_updated] == [
            r.output_token_ids for r in spec_updated
        ]
        for a, b in zip(plain.block_manager.managers, spec.block_manager.managers):
            assert a.req_to_blocks.keys() == b.req_to_blocks.keys()
            for req_id, blocks in a.req_to_blocks.items():
                assert len(blocks) <= len(b.req_to_blocks[req_id]) <= len(blocks) + 1
            cached = [
                {h for h, blk in m.block_pool.cached_blocks.items() if blk.ref_cnt} for m in (a, b)
            ]
            assert cached[0] == cached[1]
    assert not spec.has_unfinished_requests()
    assert spec.spec_num_draft_tokens > 0 and spec.spec_num_accepted_tokens == 0
    assert_no_leaks(spec)


def test_accepted_drafts_give_the_same_tokens_in_fewer_steps():
    plain, spec = spec_scheduler_pair(num_blocks=64)
    for scheduler in (plain, spec):
        scheduler.add_request(make_request("a", range(9), eos=None, max_tokens=30))
        scheduler.add_request(make_request("b", range(3, 8), eos=None, max_tokens=17))
    plain_history = run_to_completion(plain, FakeWorker(BLOCK_SIZE))
    worker, drafter = FakeWorker(BLOCK_SIZE), draft_from(history_token, right=True)
    spec_history = []
    while spec.has_unfinished_requests():
        spec_history.append(step_with_drafts(spec, worker, drafter))
    assert_no_leaks(spec)

    def tokens(history):
        final = {}
        for _, updated in history:
            final.update({r.request_id: list(r.output_token_ids) for r in updated})
        return final

    assert tokens(spec_history) == tokens(plain_history)
    assert len(tokens(spec_history)["a"]) == 30 and len(tokens(spec_history)["b"]) == 17
    assert len(spec_history) < len(plain_history) / 2
    assert spec.spec_num_accepted_tokens == spec.spec_num_draft_tokens > 0


def test_drafts_stop_at_the_budget_and_the_context_length():
    scheduler = make_scheduler(max_num_batched_tokens=3, max_model_len=14, num_blocks=64)
    scheduler.add_request(make_request("a", range(9), eos=None, max_tokens=50))
    worker = FakeWorker(BLOCK_SIZE)
    drafter = draft_from(history_token, right=True, k=5)
    step(scheduler, worker)  # prefill chunks: 9 tokens in budgets of 3
    step(scheduler, worker)
    step(scheduler, worker)
    out, _ = step_with_drafts(scheduler, worker, drafter)
    assert len(out.scheduled_spec_decode_tokens["a"]) == 2  # budget 3: one known token + 2
    out, updated = step_with_drafts(scheduler, worker, drafter)
    # 13 tokens known, context 14: no draft fits (the token after it would pass the end)
    assert "a" not in out.scheduled_spec_decode_tokens
    assert updated[0].status == RequestStatus.FINISHED_LENGTH
    assert updated[0].num_tokens == 14
    assert_no_leaks(scheduler)


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    def token_fn(req_id, tokens):
        return EOS if len(tokens) == 12 else 20 + len(tokens)

    scheduler = make_scheduler(num_blocks=64)
    scheduler.add_request(make_request("a", range(10, 20), max_tokens=50))
    worker = FakeWorker(BLOCK_SIZE, token_fn=token_fn)
    step(scheduler, worker)  # prefill: token 30
    out, [request] = step_with_drafts(scheduler, worker, draft_from(token_fn, right=True, k=4))
    assert out.scheduled_spec_decode_tokens["a"] == [31, EOS, 33, 34]
    assert request.output_token_ids == [30, 31, EOS]  # nothing after the stop token
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert_no_leaks(scheduler)


def test_lookahead_slots_are_held_where_the_pool_has_room():
    # chained MTP drafts write k - 1 positions past a step's tokens: a 4-token prompt holds
    # slots for 6 (two blocks); where only one block is free it runs without them
    scheduler = make_scheduler(num_blocks=3, num_lookahead_tokens=2)
    scheduler.add_request(make_request("a", [5, 6, 7, 8], max_tokens=4))
    scheduler.schedule()
    assert len(scheduler.block_manager.get_block_ids("a")[0]) == 2
    scheduler.add_request(make_request("b", [5, 6, 7, 9], max_tokens=4))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens.get("b") == 4  # admitted, with the last free block only
    assert len(scheduler.block_manager.get_block_ids("b")[0]) == 1
