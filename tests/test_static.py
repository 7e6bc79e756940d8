"""The static cycle (`blockpilot.decoding.static`): preallocated caches, fixed shapes, compiled or eager. At T = 0
it decodes the target's greedy output, for any block size and batch mix; compiled, it decodes what eager does.
(Its sampling at T > 0 is tested in `test_sampling_exactness.py`.)"""

from __future__ import annotations

import pytest
import torch
from support import greedy_reference

from blockpilot.decoding.static import COMPILE_MODES, StaticDecoder, StaticTarget

PROMPTS = ["Count from 3 to 14.", "Sort these numbers: 5 3 9 1", "def add(a, b):", "Reverse: a b c d e"]


def references(models, max_new_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [models.encode_prompt(text) for text in PROMPTS]
    stop = models.stop_token_ids()
    return prompts, [greedy_reference(models.target, p, max_new_tokens, stop) for p in prompts]


@pytest.mark.parametrize("width, block_sizes", [(1, None), (6, [6, 3, 1, 5]), (8, [8, 8, 8, 8])])
def test_greedy_static_decoding_is_the_targets_greedy_output(tiny_models, width, block_sizes):
    prompts, expected = references(tiny_models, 40)
    decoder = StaticDecoder(tiny_models, rows=len(prompts), width=width, capacity=128)
    outputs = decoder.generate(prompts, 40, block_sizes=block_sizes, stop_token_ids=tiny_models.stop_token_ids())
    assert outputs == expected


def test_the_static_target_computes_the_targets_logits(tiny_models):
    prompt = torch.tensor([tiny_models.encode_prompt(PROMPTS[0])])
    target = StaticTarget(tiny_models.target, rows=1, capacity=64, layer_ids=None)
    positions = torch.arange(prompt.shape[1])[None]
    mask = (torch.arange(64)[None, None, :] <= positions[:, :, None])[:, None]
    with torch.inference_mode():
        logits, _ = target(prompt, positions, positions, mask)
        expected = tiny_models.target(prompt).logits.float()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # about 30 s of compiling on 2 cores
def test_the_compiled_cycle_decodes_what_the_eager_one_does(random_models):
    """torch.compile of the whole cycle (inductor, fullgraph) on the random zoo: greedy rows decode the target's
    greedy output, sampled rows what eager sampling gives for their seeds."""
    prompts, expected = references(random_models, 24)
    settings = dict(block_sizes=[4, 2, 3, 4], stop_token_ids=random_models.stop_token_ids())
    sampled = dict(settings, temperatures=[0.0, 0.8, 0.0, 1.2], seeds=[0, 1, 2, 3])
    eager = StaticDecoder(random_models, rows=4, width=4, capacity=96, sampling=True)
    compiled = StaticDecoder(random_models, rows=4, width=4, capacity=96, sampling=True, compile="compile")
    assert compiled.generate(prompts, 24, **settings) == expected
    assert compiled.compile_seconds is not None and compiled.compile_seconds > 0
    assert compiled.generate(prompts, 24, **sampled) == eager.generate(prompts, 24, **sampled)


def test_bad_settings_are_refused_naming_the_value(random_models):
    with pytest.raises(ValueError, match="compile must be one of"):
        StaticDecoder(random_models, rows=1, width=2, capacity=32, compile="fast")
    assert "graph" in COMPILE_MODES
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            StaticDecoder(random_models, rows=1, width=2, capacity=32, compile="graph")
    decoder = StaticDecoder(random_models, rows=2, width=4, capacity=32)
    with pytest.raises(ValueError, match="block sizes in"):
        decoder.start([[1, 2], [3]], block_sizes=[5, 1])
    with pytest.raises(ValueError, match="sampling=True"):
        decoder.start([[1, 2], [3]], temperatures=[0.5, 0.0])
    with pytest.raises(ValueError, match="do not fit 32 slots"):
        decoder.start([[1] * 30, [3]])


def test_rows_that_finish_early_hold_their_place_while_the_others_run(tiny_models):
    """Rows that stop early keep cycling in place: the cache need only fit the longest prompt and the budget, however
    long the other rows run, and every row still decodes its greedy output."""
    prompts, expected = references(tiny_models, 60)
    assert len({len(tokens) for tokens in expected}) > 1, "the rows should end at different lengths"
    capacity = max(map(len, prompts)) + 60 + 8
    decoder = StaticDecoder(tiny_models, rows=4, width=8, capacity=capacity)
    assert decoder.generate(prompts, 60, stop_token_ids=tiny_models.stop_token_ids()) == expected
    for prompt, tokens, length in zip(prompts, expected, decoder.length.tolist(), strict=True):
        assert length < len(prompt) + len(tokens) + 8  # at most the finishing cycle's dropped tokens past its end
    with pytest.raises(ValueError, match="do not fit"):
        decoder.generate(prompts, 61)
