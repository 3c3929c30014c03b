"""Generation is captured as one stream per prompt: ``Capture.generate``.

The prompt's prefill and every decoding step are joined into one record per layer call, positions
continuing the prompt's; the state a step starts from must be the one the step before left. The
independent check: the same prompt followed by the same tokens, run as one prefill (no cache, no
decoding), gives the same per-token ratios (fp32, CPU, 1e-5), and the tokens are those of a plain
greedy loop that recomputes the whole sequence for every token (no cache at all).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import osdn_diag
from osdn_diag.capture.generation import GenerationError
from osdn_diag.models import load_model

#: One model per way a decoding state is carried: fla's delta rule, its gated rule, its key-channel
#: gate (KDA), the package's OSDN layer (d carried beside S), a transformers model (its own cache
#: class, ``cache=``) and an fla family with a further state (MomentumDeltaNet's momentum).
MODELS = ["random:deltanet-tiny", "random:gated-deltanet-tiny", "random:kda-tiny", "builtin:mqar-osdn",
          "random:qwen3.5-tiny", "random:momentum-deltanet-tiny"]
N = 5


@pytest.fixture(scope="module")
def models(fla_kernels):
    return {spec: load_model(spec, dtype=torch.float32).model for spec in MODELS}


def _prompt(vocab: int, length: int = 19, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 200), (1, length), generator=g)


def _rows(results) -> dict[str, np.ndarray]:
    t = results.table
    cols = {c: t.column(c).to_numpy() for c in ("layer", "head", "pos", "residual_ratio", "decode_start")}
    order = np.lexsort((cols["pos"], cols["head"], cols["layer"]))
    return {c: v[order] for c, v in cols.items()}


def _greedy_without_cache(model, prompt: torch.Tensor, n: int) -> list[int]:
    """Greedy tokens recomputed from the whole sequence each time (under a capture only so that the
    CPU runs the package's recurrence rather than fla's interpreted kernels; nothing is decoded)."""
    ids = prompt
    with osdn_diag.capture(model), torch.inference_mode():
        for _ in range(n):
            nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    return ids[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("spec", MODELS)
def test_prompt_and_generated_tokens_replay_as_one_prefill(models, spec):
    model = models[spec]
    # The OSDN model's prompt is longer than 64 tokens: its prefill takes the chunk path, which
    # records the write key it read, its decoding steps the fused kernel, which records none.
    prompt = _prompt(model.config.vocab_size, 70 if "osdn" in spec else 19)
    with osdn_diag.capture(model) as cap:
        tokens = cap.generate(prompt, N)
    assert tokens.shape == (1, N)
    assert tokens[0].tolist() == _greedy_without_cache(model, prompt, N)
    assert {c.forward for c in cap.calls} == {0}
    for call in cap.calls:  # one stream per layer call: prompt + tokens, the boundary recorded
        assert call.k.shape[:2] == (1, prompt.shape[1] + N)
        assert call.flags["decode_start"] == prompt.shape[1]
        assert call.flags["state_handoff_error"] == 0.0
    with osdn_diag.capture(model) as whole, torch.inference_mode():
        model(input_ids=torch.cat([prompt, tokens], 1), use_cache=False)
    got, want = _rows(osdn_diag.replay(cap)), _rows(osdn_diag.replay(whole))
    for name in ("layer", "head", "pos"):
        np.testing.assert_array_equal(got[name], want[name])
    assert np.isfinite(got["residual_ratio"]).all()
    # The OSDN model's two paths compute its preconditioner d differently (the prefill's phase 1 by a
    # blocked solve over the prompt, decoding by the sequential sweep), which agree to fp32 rounding;
    # one ratio in 300 then differs by 1.3e-5. Every other model runs the same arithmetic both ways.
    rtol = 3e-5 if "osdn" in spec else 1e-5
    np.testing.assert_allclose(got["residual_ratio"], want["residual_ratio"], rtol=rtol, atol=1e-7)
    assert set(got["decode_start"]) == {prompt.shape[1]} and set(want["decode_start"]) == {-1}


def test_two_generations_are_two_prompts(models):
    model = models["random:deltanet-tiny"]
    with osdn_diag.capture(model) as cap:
        cap.generate(_prompt(256, 7, seed=1), 3)
        cap.generate(_prompt(256, 11, seed=2), 4)
    res = osdn_diag.replay(cap)
    prompts = res.table.column("prompt").to_numpy()
    pos = res.table.column("pos").to_numpy()
    assert sorted(set(prompts)) == [0, 1]
    assert pos[prompts == 0].max() == 7 + 3 - 1 and pos[prompts == 1].max() == 11 + 4 - 1
    phases = res.summary["by_phase"]
    assert phases["prefill"]["n"] == (7 + 11) * 2 * 2 and phases["decode"]["n"] == (3 + 4) * 2 * 2


def test_prompts_given_alone_get_the_generated_tokens_and_prompts_that_are_not_the_capture_are_refused(models):
    from osdn_diag.prompts import Prompt

    model = models["random:deltanet-tiny"]
    first, second = _prompt(256, 7, seed=1), _prompt(256, 11, seed=2)
    with osdn_diag.capture(model) as cap:
        a = cap.generate(first, 3)
        b = cap.generate(second, 4)
    assert cap.generated == {0: a[0].tolist(), 1: b[0].tolist()}
    alone = [Prompt(id=0, task="x", input_ids=first[0].tolist()),  # the prompt alone
             Prompt(id=1, task="y", input_ids=second[0].tolist() + b[0].tolist())]  # with its tokens
    tokens = osdn_diag.replay(cap, prompts=alone).tokens.to_pydict()
    by_prompt = {p: [t for q, t in zip(tokens["prompt"], tokens["token_id"]) if q == p] for p in (0, 1)}
    assert by_prompt == {0: first[0].tolist() + a[0].tolist(), 1: second[0].tolist() + b[0].tolist()}
    with pytest.raises(ValueError, match=r"argument 'prompts': 1 prompts for the 2 sequences captured in 2 forward"):
        osdn_diag.replay(cap, prompts=alone[:1])
    short = [alone[0], Prompt(id=1, task="y", input_ids=second[0].tolist()[1:])]
    with pytest.raises(ValueError, match=r"prompt 1 \(id 1\) holds 10 token ids, but captured sequence 1 is 15 "
                                         r"tokens long.*its prompt alone \(11 ids\)"):
        osdn_diag.replay(cap, prompts=short)
    with osdn_diag.capture(model) as plain, torch.inference_mode():
        model(input_ids=first)
    with pytest.raises(ValueError, match=r"prompt 0 \(id 0\) holds 8 token ids, but captured sequence 0 is 7"):
        osdn_diag.replay(plain, prompts=[Prompt(id=0, task="x", input_ids=[1] + first[0].tolist())])


def test_a_micro_step_family_marks_its_generated_tokens_in_tokens(fla_kernels):
    """GatedDeltaProduct's record has two rows per token (its micro-steps), its table one position per
    token: the boundary is the prompt's length in tokens."""
    model = load_model("random:gated-deltaproduct-tiny", dtype=torch.float32).model
    with osdn_diag.capture(model) as cap:
        cap.generate(_prompt(256, 9), 3)
    assert all(c.flags["decode_start"] == 9 and c.k.shape[1] == 2 * (9 + 3) for c in cap.calls)
    res = osdn_diag.replay(cap)
    pos = res.table.column("pos").to_numpy()
    assert pos.max() == 9 + 3 - 1
    phases = res.summary["by_phase"]
    assert phases["decode"]["n"] == int((pos >= 9).sum()) > 0 and phases["prefill"]["n"] == int((pos < 9).sum())


def test_a_state_that_is_not_carried_is_refused(models, monkeypatch):
    """Decoding steps handed the cache under a name the model does not read (what transformers 5's
    generate() does to fla 0.6.0's models) start from nothing: refused, naming the versions."""
    from osdn_diag.capture import generation

    monkeypatch.setattr(generation, "cache_argument", lambda model: "cache")
    model = models["random:gated-deltanet-tiny"]
    with osdn_diag.capture(model) as cap, pytest.raises(GenerationError) as err:
        cap.generate(_prompt(256), 2)
    msg = str(err.value)
    assert "did not start from the state" in msg and "transformers" in msg and "flash-linear-attention" in msg
    assert "\n" not in msg
    assert cap.calls == []


def test_model_generate_under_capture_is_refused_and_restored(models):
    model = models["random:deltanet-tiny"]
    with osdn_diag.capture(model) as cap, pytest.raises(RuntimeError, match=r"cap\.generate"):
        model.generate(_prompt(256), max_new_tokens=2)
    assert cap.calls == []
    assert "generate" not in vars(model)  # the class's own generate() is back
    assert callable(model.generate)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_max_new_tokens_is_checked(models, bad):
    with osdn_diag.capture(models["random:deltanet-tiny"]) as cap, pytest.raises(ValueError, match="max_new_tokens"):
        cap.generate(_prompt(256), bad)


def test_a_batch_is_refused(models):
    with osdn_diag.capture(models["random:deltanet-tiny"]) as cap, pytest.raises(ValueError, match="one sequence"):
        cap.generate(torch.ones(2, 5, dtype=torch.long), 2)


def _part(T: int, seed: int, initial=None, final=None):
    """One forward pass's call of a one-layer, one-head delta rule (K = V = 2) over ``T`` tokens."""
    from osdn_diag.capture import KernelCall

    gen = torch.Generator().manual_seed(seed)
    x = lambda *s: torch.randn(1, T, *s, generator=gen)  # noqa: E731
    return KernelCall(layer=0, layer_name="layers.0", family="delta_rule", kernel="k", q=x(1, 2), k=x(1, 2),
                      v=x(1, 2), beta=torch.rand(1, T, 1, generator=gen), o=x(1, 2), scale=0.5,
                      initial_state=initial, final_state=final)


def test_stitch_joins_a_prefill_and_its_steps_into_one_stream():
    """Pure: the joined call holds every token in order, says where decoding starts (the prompt's
    length, the first generated token's position), starts from the prefill's initial state and ends
    in the last step's final state."""
    from osdn_diag.capture.generation import stitch

    s0, s1, s2 = (torch.randn(1, 1, 2, 2, generator=torch.Generator().manual_seed(i)) for i in range(3))
    parts = [_part(5, 1, None, s0), _part(1, 2, s0.clone(), s1), _part(1, 3, s1.clone(), s2)]
    (joined,) = stitch([[p] for p in parts], prompt_length=5)
    assert joined.flags["decode_start"] == 5 and joined.flags["state_handoff_error"] == 0.0
    assert torch.equal(joined.k, torch.cat([p.k for p in parts], dim=1))
    assert joined.initial_state is None and joined.final_state is s2


@pytest.mark.parametrize("where", ["finite", "nonfinite"])
def test_stitch_refuses_a_step_that_did_not_start_from_the_state_left(where):
    """A state with NaN/Inf is carried only bit for bit where it is non-finite and within tolerance where
    it is finite; a NaN appearing in the hand-off is a difference, never within tolerance."""
    from osdn_diag.capture.generation import stitch

    s0 = torch.tensor([[[[1.0, 4.0 if where == "finite" else float("nan")], [2.0, 3.0]]]])
    start = s0.clone()
    if where == "finite":
        start[0, 0, 1, 0] = float("nan")  # all finite before, a NaN after: the difference is NaN
    else:
        start[0, 0, 1, 1] = 3.5  # beside the NaN carried, a finite entry moved
    parts = [_part(4, 1, None, s0), _part(1, 2, start, None)]
    with pytest.raises(GenerationError, match="decoding step 1 did not start from the state the step before left"):
        stitch([[p] for p in parts], prompt_length=4)
    (ok,) = stitch([[_part(4, 1, None, s0)], [_part(1, 2, s0.clone(), None)]], prompt_length=4)
    assert ok.flags["state_handoff_error"] == 0.0
