"""HF Whisper's encoder trained with AdamW through the ordinary loop (``torch.compile`` + ``keep_on_device``) and the
resident step (``compile_train_step``), judged against float64: each path's losses within twice eager float32's own
distance from float64's (``assert_within_eager_error``), over the same steps from the same weights and seeds.

The loss is the issue's, ``(last_hidden_state ** 2).mean()``: about 1 (the output is layer-normed), so eager float32
is about 1e-7 from float64, a few units in the last place; a wrong gradient moves the next step's loss by AdamW's
step size (1e-3 relative here), ten thousand times that.

``encoder_layerdrop`` > 0 puts HF's layerdrop branch (``if torch.rand([]) < layerdrop``, taken in training) in the
forward, as transformers 5.17 has it unguarded: dynamo cannot resume inside the layer loop, so it runs the encoder's
forward in eager PyTorch and compiles each layer as a graph of its own. There dynamo compiled the parameters'
``__torch_function__`` override as frames of its own, one graph per op, recompiled with automatic dynamic sizes
(a convolution's stride as a SymInt): ``BackendCompilerFailed: 'SymInt' object has no attribute 'dtype'``.
``NEVER_DROPS`` keeps the branch but drops no layer (``torch.rand`` in float32 is below it only where it draws
exactly 0, at odds of 2^-24 per layer), as 5.17 at Whisper's default layerdrop of 0.
"""
import copy
import warnings

import pytest
import torch

import torch_meganeura
from helpers.compare import assert_within_eager_error, meganeura_warnings

NEVER_DROPS = 1e-9
LR = 1e-3
SMALL = dict(d_model=32, encoder_attention_heads=4, encoder_layers=2, encoder_ffn_dim=64, decoder_layers=1,
             decoder_attention_heads=4, num_mel_bins=8, max_source_positions=16)
SEED = 100  # step i runs under torch.manual_seed(SEED + i) on every side: the same layerdrop draws


def whisper_encoder(**config):
    """A Whisper encoder in training mode and a mel batch of its size (two frames per position)."""
    from transformers import WhisperConfig, WhisperModel

    config = WhisperConfig(**config)
    encoder = WhisperModel(config).get_encoder().train()
    return encoder, torch.randn(1, config.num_mel_bins, 2 * config.max_source_positions)


def loss_of(model, mel):
    return (model(mel).last_hidden_state ** 2).mean()


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def loop_losses(module, opt, mel, steps: int) -> list[float]:
    """``steps`` steps of the usual loop (each under its own seed: the same layerdrop draws); their losses."""
    losses = []
    for i in range(steps):
        torch.manual_seed(SEED + i)
        loss = loss_of(module, mel)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def eager_losses(encoder, mel, steps: int, dtype: torch.dtype) -> list[float]:
    model = copy.deepcopy(encoder).to(dtype)
    return loop_losses(model, adamw(model.parameters()), mel.to(dtype), steps)


def ordinary_loop_losses(encoder, mel, steps: int) -> list[float]:
    """The ordinary loop through the backend, with no fallback allowed."""
    model = copy.deepcopy(encoder)
    opt = torch_meganeura.keep_on_device(adamw(model.parameters()))
    torch._dynamo.reset()
    return loop_losses(torch.compile(model, backend="meganeura", options={"fallback": "error"}), opt, mel, steps)


def resident_step_losses(encoder, mel, steps: int) -> list[float]:
    model = copy.deepcopy(encoder)
    torch._dynamo.reset()
    step = torch_meganeura.compile_train_step(model, loss_of, adamw(model.parameters()))
    losses = []
    for i in range(steps):
        torch.manual_seed(SEED + i)
        losses.append(float(step(mel)))
    return losses


def check_both_paths(encoder, mel, steps: int) -> None:
    exact = torch.tensor(eager_losses(encoder, mel, steps, torch.float64))
    eager = torch.tensor(eager_losses(encoder, mel, steps, torch.float32))
    for path in (ordinary_loop_losses, resident_step_losses):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = torch.tensor(path(encoder, mel, steps))
        fallbacks = [m for m in meganeura_warnings(caught) if "eager PyTorch" in m]  # (not: "eager Python between")
        assert not fallbacks, fallbacks
        assert_within_eager_error(got, eager, exact, what=f"{path.__name__} over {steps} steps")


def test_small_whisper_encoder_with_the_layerdrop_branch_trains_on_both_paths():
    """Both paths, 5 AdamW steps (seconds on lavapipe). Before the fix: the SymInt crash in the ordinary loop, and in
    the resident step (which runs the loss as device graphs with eager glue) a bind group over a destroyed arena."""
    encoder, mel = whisper_encoder(**SMALL, encoder_layerdrop=NEVER_DROPS)
    check_both_paths(encoder, mel, steps=5)


def test_layers_dropped_by_layerdrop_keep_their_own_adamw_step_count_in_the_resident_step():
    """Layerdrop 0.5 drops layer 0 at steps 1-3 and layer 1 at steps 2 and 4 (seeds SEED + i): eager AdamW leaves a
    parameter with no gradient alone, its step count included. The ordinary loop does (per-parameter counts,
    ``device_optimizer``), and so does the resident step (``TrainStep.param_steps``). With one count for all, a
    parameter whose layer was dropped got the next step's bias correction: the loss at step 5 was 4e-5 from float64
    where eager float32 is 1e-7."""
    encoder, mel = whisper_encoder(**SMALL, encoder_layerdrop=0.5)
    exact = torch.tensor(eager_losses(encoder, mel, 5, torch.float64))
    eager = torch.tensor(eager_losses(encoder, mel, 5, torch.float32))
    assert_within_eager_error(torch.tensor(ordinary_loop_losses(encoder, mel, 5)), eager, exact, what="ordinary loop")
    assert_within_eager_error(torch.tensor(resident_step_losses(encoder, mel, 5)), eager, exact, what="resident step")


@pytest.mark.slow
def test_full_size_whisper_tiny_encoder_trains_5_adamw_steps_on_both_paths():
    """Whisper-tiny's encoder at full size (WhisperConfig's defaults: d_model 384, 4 layers of 6 heads, 80 mel bins x
    3000 frames), with the layerdrop branch: the issue's ordinary loop, and the resident step."""
    encoder, mel = whisper_encoder(encoder_layerdrop=NEVER_DROPS)
    check_both_paths(encoder, mel, steps=5)
