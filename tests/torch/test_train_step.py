"""Device-resident training (compile_train_step) against eager torch.optim, step by step.

50 AdamW steps (weight decay, cosine LR schedule) and 50 SGD steps (momentum, weight decay) on a small HF Llama, and
50 SGD steps (momentum, nesterov, weight decay) on a small HF ResNet with BatchNorm (a full ResNet-50 with AdamW is
in test_train_step_resnet50.py, marked slow): the loss of every step within 1e-4 relative, then the final weights,
BatchNorm statistics and optimizer state elementwise. A checkpoint saved at step 25 and loaded in a fresh process
continues with the uninterrupted run's losses. Gradient clipping against clip_grad_norm_, gradient accumulation against
the usual loop, gradients() against eager, a compiled optimizer.step, refusals, and steady steps that allocate
nothing."""
import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from meganeura.runtime.device import get_device
from torch_meganeura import compile_train_step
from torch_meganeura.training.roles import Mode

LLAMA = dict(vocab_size=64, hidden_size=72, intermediate_size=96, num_hidden_layers=2, num_attention_heads=9,
             num_key_value_heads=3, max_position_embeddings=64)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**LLAMA)).train()


def _llama_loss(model, ids):
    return model(ids, labels=ids, use_cache=False).loss


def _ids(step):
    return (torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1000 + step)),)


def _run_both(model, loss_fn, make_optimizer, batches, steps, **options):
    """Train ``model`` through compile_train_step and a deep copy eagerly; returns both sides and the losses."""
    ref = copy.deepcopy(model)
    opt, ref_opt = make_optimizer(model), make_optimizer(ref)
    sched, ref_sched = (torch.optim.lr_scheduler.CosineAnnealingLR(o, steps) for o in (opt, ref_opt))
    step = compile_train_step(model, loss_fn, opt, **options)
    losses = []
    for i in range(steps):
        batch = batches(i)
        got = step(*batch)
        sched.step()
        ref_opt.zero_grad()
        want = loss_fn(ref, *batch)
        want.backward()
        if options.get("max_grad_norm") is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), options["max_grad_norm"])
        ref_opt.step()
        ref_sched.step()
        losses.append((float(got), float(want.detach())))
    return step, ref, ref_opt, losses


def _assert_losses(losses, rel=1e-4):
    for i, (got, want) in enumerate(losses):
        assert abs(got - want) <= rel * abs(want), f"step {i + 1}: loss {got} vs eager {want}"


# 23 s on the 2-core machine: 50 steps and a fresh process (the slow stage: docs/architecture.md, Tests)
@pytest.mark.slow
def test_adamw_cosine_llama_50_steps_and_checkpoint_resume_in_a_fresh_process(tmp_path):
    torch.manual_seed(0)
    model = _llama()
    checkpoint = tmp_path / "step25.safetensors"

    def make_optimizer(m):
        return torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)

    ref = copy.deepcopy(model)
    opt, ref_opt = make_optimizer(model), make_optimizer(ref)
    sched, ref_sched = (torch.optim.lr_scheduler.CosineAnnealingLR(o, 50) for o in (opt, ref_opt))
    step = compile_train_step(model, _llama_loss, opt)
    losses = []
    for i in range(50):
        got = float(step(*_ids(i)))
        sched.step()
        if i + 1 == 25:
            step.save(checkpoint)
        ref_opt.zero_grad()
        want = _llama_loss(ref, *_ids(i))
        want.backward()
        ref_opt.step()
        ref_sched.step()
        losses.append((got, float(want.detach())))
    _assert_losses(losses)
    step.sync_to_module()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")
        for slot in ("exp_avg", "exp_avg_sq"):  # moments of f32 gradients: within 1e-3 of the tensor's scale
            want = ref_opt.state[q][slot]
            torch.testing.assert_close(opt.state[p][slot], want, rtol=1e-3, atol=1e-3 * float(want.abs().max()),
                                       msg=lambda m: f"{name} {slot}: {m}")
        assert float(opt.state[p]["step"]) == 50

    resumed = _resume_in_subprocess(checkpoint, first=25, last=50)
    assert resumed == [got for got, _ in losses[25:]], (resumed, losses[25:])


def _resume_in_subprocess(checkpoint, first: int, last: int) -> list[float]:
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.modules["test_train_step"] = None  # nothing from the parent process: a fresh model and optimizer
        from transformers import LlamaConfig, LlamaForCausalLM
        from torch_meganeura import compile_train_step
        model = LlamaForCausalLM(LlamaConfig(**{LLAMA!r})).train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 50)
        for _ in range({first}):
            sched.step()
        step = compile_train_step(model, lambda m, ids: m(ids, labels=ids, use_cache=False).loss, opt)
        step.load({str(checkpoint)!r})
        assert step.steps == {first}
        losses = []
        for i in range({first}, {last}):
            ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1000 + i))
            losses.append(float(step(ids)))
            sched.step()
        print(json.dumps(losses))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 10 s on the 2-core machine: 50 steps (the slow stage: docs/architecture.md, Tests)
def test_sgd_nesterov_resnet_with_batchnorm_50_steps():
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    model = ResNetForImageClassification(ResNetConfig(embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1],
                                                      num_labels=10)).train()
    gen = torch.Generator().manual_seed(0)
    # batches of 8 at 32x32: with fewer samples per BatchNorm channel, rounding differences grow chaotically
    data = [(torch.randn(8, 3, 32, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)) for _ in range(4)]

    def loss_fn(m, x, y):
        return F.cross_entropy(m(pixel_values=x).logits, y)

    def make_optimizer(m):  # at lr 1e-2 this small net's trajectory is chaotic: any two f32 implementations part
        return torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9, nesterov=True, weight_decay=1e-3)

    step, ref, ref_opt, losses = _run_both(model, loss_fn, make_optimizer, lambda i: data[i % 4], 50)
    _assert_losses(losses)
    state = step.state_dict()  # synced from the device: parameters and BatchNorm statistics
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(state[name].to(want.dtype), want, rtol=1e-3, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
    assert int(state["resnet.embedder.embedder.normalization.num_batches_tracked"]) == 50


def test_sgd_momentum_llama_50_steps():
    torch.manual_seed(3)
    model = _llama()

    def make_optimizer(m):
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)

    step, ref, _, losses = _run_both(model, _llama_loss, make_optimizer, _ids, 50)
    _assert_losses(losses)
    state = step.state_dict()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(state[name], want, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_steady_steps_create_no_buffers_or_bind_groups():
    """Each state role alternates between two buffers, so once both have been written the plan replays cached
    bind groups: a step allocates nothing and uploads only the batch and the hyperparameters."""
    torch.manual_seed(5)
    model = _llama()
    step = compile_train_step(model, _llama_loss, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for i in range(3):
        step(*_ids(i))
    counters = get_device().counters
    before = counters.snapshot()
    for i in range(3, 6):
        step(*_ids(i))
    after = counters.snapshot()
    assert after["bind_groups_created"] == before["bind_groups_created"]
    assert after["buffers_created"] == before["buffers_created"]
    per_step = (after["bytes_uploaded"] - before["bytes_uploaded"]) / 3
    assert per_step < 1024, f"{per_step} bytes uploaded per step"


def test_parameters_and_optimizer_state_are_held_once():
    """The plan stores each new parameter and AdamW state over its old value (lowering/in_place.py): the step keeps a
    second array only for the few updates it cannot store in place, under 1 % of those bytes here, and the device
    holds less than with a second copy of everything."""
    torch.manual_seed(6)
    model = _llama()
    step = compile_train_step(model, _llama_loss, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for i in range(2):
        step(*_ids(i))
    updated = sum(4 * p.numel() for p in model.parameters()) * 3  # each parameter, exp_avg and exp_avg_sq
    spare = sum(array.nbytes for array in step._spare.values())
    assert spare < 0.01 * updated, f"{spare} of {updated} bytes held twice"
    (compiled,) = step._plans.values()
    assert compiled.program.plan.stats["in_place_bytes"] > 0.99 * updated


def test_released_plans_give_their_memory_back_and_compile_again():
    """``gradients()`` compiles a plan of its own; ``release_plans(Mode.GRADS)`` gives its arena, outputs and staging
    back (the parameters and optimizer state stay), and a later call compiles it again with the same result."""
    torch.manual_seed(8)
    model = _llama()
    step = compile_train_step(model, _llama_loss, torch.optim.AdamW(model.parameters(), lr=1e-3))
    counters = get_device().counters
    before = counters.bytes_allocated
    loss, grads = step.gradients(*_ids(0))
    held = counters.bytes_allocated - before
    step.release_plans(Mode.GRADS)
    assert counters.bytes_allocated - before < 0.01 * held
    again, grads_again = step.gradients(*_ids(0))
    assert torch.equal(loss, again) and all(torch.equal(grads[n], grads_again[n]) for n in grads)
    step(*_ids(1))  # the training step is unaffected


def test_a_step_that_fails_a_check_changes_nothing():
    """A token id past the vocabulary fails a range check: the step raises and changes nothing (the in-place updates
    are guarded by the status word, the step count stays). The run goes on exactly, bit for bit, as one that never
    saw the bad batch, and its losses match eager's."""
    torch.manual_seed(7)
    model = _llama()
    models = [model, copy.deepcopy(model), copy.deepcopy(model)]  # with the bad batch, without it, eager
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
    steps = [compile_train_step(m, _llama_loss, o) for m, o in zip(models[:2], opts[:2])]
    bad = _ids(1)[0].clone()
    bad[0, 3] = LLAMA["vocab_size"]
    losses = []
    for i in (0, 2, 3):
        if i == 2:
            with pytest.raises(RuntimeError, match="index out of range"):
                steps[0](bad)
        losses.append([float(step(*_ids(i))) for step in steps])
        opts[2].zero_grad()
        want = _llama_loss(models[2], *_ids(i))
        want.backward()
        opts[2].step()
        losses[-1].append(float(want))
    for got, clean, want in losses:
        assert got == clean and abs(got - want) <= 1e-4 * abs(want), (got, clean, want)
    for step in steps:
        step.sync_to_module()
    for (name, got), clean in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        assert torch.equal(got, clean), name
    for got, clean in zip(opts[0].state.values(), opts[1].state.values()):
        assert all(torch.equal(got[slot], clean[slot]) for slot in got)


def test_gradient_clipping_by_global_norm_matches_clip_grad_norm():
    torch.manual_seed(1)
    model = _llama()
    _, _, _, losses = _run_both(model, _llama_loss, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), _ids, 6,
                                max_grad_norm=0.05)
    _assert_losses(losses)


def test_module_is_stale_until_synced():
    torch.manual_seed(2)
    model = _llama()
    before = model.lm_head.weight.detach().clone()
    step = compile_train_step(model, _llama_loss, torch.optim.SGD(model.parameters(), lr=0.5))
    step(*_ids(0))
    assert torch.equal(model.lm_head.weight, before)  # the device holds the truth between steps
    step.sync_to_module()
    assert not torch.equal(model.lm_head.weight, before)


def test_sgd_momentum_continues_from_an_eager_step():
    """SGD keeps no step count: a momentum buffer left by an eager step must make the device's next step a
    momentum step (buf = momentum * buf + grad), not a first one (buf = grad)."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.3) for m in (model, ref))
    loss_fn = lambda m, x: m(x).pow(2).mean()  # noqa: E731
    x0, x1 = torch.randn(8, 6), torch.randn(8, 6)
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        loss_fn(m, x0).backward()
        o.step()
    step = compile_train_step(model, loss_fn, opt)
    step(x1)
    ref_opt.zero_grad()
    loss_fn(ref, x1).backward()
    ref_opt.step()
    step.sync_to_module()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_unsupported_optimizers_are_refused_by_name():
    model = _llama()
    with pytest.raises(NotImplementedError, match="RMSprop"):
        compile_train_step(model, _llama_loss, torch.optim.RMSprop(model.parameters()))
    with pytest.raises(NotImplementedError, match="amsgrad"):
        compile_train_step(model, _llama_loss, torch.optim.Adam(model.parameters(), amsgrad=True))


def test_compiled_optimizer_step_runs_on_the_device():
    """torch.compile(opt.step, backend="meganeura") lowers AdamW's update (prims.fma included): no fallback."""
    import warnings

    from helpers.compare import meganeura_warnings

    model = torch.nn.Linear(8, 4)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, ref))
    step = torch.compile(opt.step, backend="meganeura")
    for _ in range(3):
        x = torch.randn(5, 8)
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        assert not meganeura_warnings(caught), meganeura_warnings(caught)
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_gradients_match_eager_and_change_nothing():
    torch.manual_seed(3)
    model = _llama()
    ref = copy.deepcopy(model)
    step = compile_train_step(model, _llama_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    loss, grads = step.gradients(*_ids(0))
    want = _llama_loss(ref, *_ids(0))
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=0)
    assert set(grads) == {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")
    again, _ = step.gradients(*_ids(0))
    assert float(again) == float(loss) and step.steps == 0


def test_detach_in_the_model_stops_the_gradient():
    class StopGradient(torch.nn.Module):  # value v, gradient 3 times v's
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            v = self.lin(x)
            return v * 3 - v.detach() * 2

    torch.manual_seed(0)
    model, x, y = StopGradient(), torch.randn(5, 4), torch.randint(0, 3, (5,))
    ref = copy.deepcopy(model)
    step = compile_train_step(model, lambda m, x, y: F.cross_entropy(m(x), y), torch.optim.SGD(model.parameters()))
    _, grads = step.gradients(x, y)
    F.cross_entropy(ref(x), y).backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_gradient_accumulation_matches_the_usual_loop():
    """accumulation_steps=3: each micro-batch's loss / 3 is differentiated and added up on the device, AdamW
    updates on every third call; eager runs (loss / 3).backward() three times, then step() and zero_grad()."""
    torch.manual_seed(4)
    model = _llama()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1) for m in (model, ref))
    step = compile_train_step(model, _llama_loss, opt, accumulation_steps=3, max_grad_norm=0.5)
    losses = []
    for i in range(12):
        got = float(step(*_ids(i)))
        want = _llama_loss(ref, *_ids(i)) / 3
        want.backward()
        if i % 3 == 2:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
        losses.append((got, float(want.detach())))
    _assert_losses(losses)
    assert step.steps == 4 and step.micro_batches == 0
    step.sync_to_module()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_lr_scheduler_and_step_hooks_see_every_update():
    """Each update runs inside optimizer.step: an LR scheduler stepped after it warns of nothing and gives eager's
    learning rates; the step hooks run once an update (not on accumulating micro-batches), and a pre-hook's change of
    the learning rate applies to that update, as in eager. A stale .grad is neither applied nor lost."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (opt, ref_opt)]
    calls = []

    def pre_hook(optimizer, args, kwargs):
        calls.append(("pre", optimizer is opt))
        for group in optimizer.param_groups:
            group["lr"] *= 0.8

    def post_hook(optimizer, args, kwargs):
        calls.append(("post", optimizer is opt))

    for o in (opt, ref_opt):
        o.register_step_pre_hook(pre_hook)
        o.register_step_post_hook(post_hook)
    step = compile_train_step(model, lambda m, x: m(x).pow(2).mean(), opt, accumulation_steps=2)
    stale = model.weight.grad = torch.full_like(model.weight, 100.0)
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(6):
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(i))
            step(x)
            (ref(x).pow(2).mean() / 2).backward()
            if i % 2:
                ref_opt.step()
                ref_opt.zero_grad()
                for scheduler in schedulers:
                    scheduler.step()
                lrs.append((opt.param_groups[0]["lr"], ref_opt.param_groups[0]["lr"]))
    assert not [w for w in caught if "optimizer.step()" in str(w.message)], [str(w.message) for w in caught]
    assert calls == [("pre", True), ("post", True), ("pre", False), ("post", False)] * 3, calls
    assert all(got == want for got, want in lrs), lrs
    assert model.weight.grad is stale and bool((stale == 100.0).all())
    step.sync_to_module()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_many_train_steps_in_one_process():
    """Each step's dynamo capture is independent: more steps than dynamo's recompile limit (8) all compile."""
    for _ in range(10):
        model = torch.nn.Linear(4, 2)
        ref = copy.deepcopy(model)
        step = compile_train_step(model, lambda m, x: m(x).pow(2).mean(), torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.randn(3, 4)
        torch.testing.assert_close(step(x), ref(x).pow(2).mean().detach(), rtol=1e-5, atol=1e-6)
