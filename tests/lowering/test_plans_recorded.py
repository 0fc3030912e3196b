"""Compiled graphs instantiated on the recording device (tests/helpers/recording_device.py), with no GPU: how many
kernels a fused chain takes, where its intermediates live in the arena, what each dispatch binds, and that a program
replays them. Plans are generated for the recording device's limits (WebGPU's defaults)."""
import numpy as np

from meganeura.lowering import compile_graph
from meganeura.lowering import expr as E
from meganeura.lowering.builder import GraphBuilder
from meganeura.runtime.program import Program

from helpers.recording_device import RecordingDevice

RNG = np.random.default_rng(5)


def instantiate(graph):
    """(device, plan, program) of ``graph`` compiled for a new recording device."""
    device = RecordingDevice()
    plan, _ = compile_graph(graph, device.limits)
    return device, plan, Program(device, plan)


def test_pointwise_chain_is_one_kernel_from_input_to_output():
    """Five elementwise ops in a row: one kernel, one dispatch reading the input and writing the output, no arena."""
    b = GraphBuilder()
    y = b.input("x", (64, 32), "float32")
    for op in ("exp", "tanh", "abs", "sqrt"):
        y = b.map(lambda a, op=op: E.unary(op, a), y, dtype="float32")
    b.output(b.map(lambda a: E.add(a, E.const(1.0, E.F32)), y, dtype="float32"))
    device, plan, program = instantiate(b.graph)
    assert plan.stats["arena_bytes"] == 0 and [spec.role for spec in plan.buffers] == ["input", "output"]
    program.run({"x": RNG.standard_normal((64, 32)).astype(np.float32)})
    ((kernel, _, bindings),) = device.dispatched()
    assert len(device.compiled) == 1 and device.compiled[0][2] == kernel
    assert bindings == (("input:x", 0, 8192), ("out0", 0, 8192))


def test_softmax_chain_keeps_one_intermediate_in_the_arena():
    """exp(2 x) feeds a row sum and the division by it: two kernels (the division runs in the reduction's kernel);
    the first writes exp(2 x) into the arena, the second reads that range and writes the output."""
    b = GraphBuilder()
    x = b.input("x", (4, 8), "float32")
    y = b.map(lambda a: E.unary("exp", E.mul(a, E.const(2.0, E.F32))), x, dtype="float32")
    s = b.reduce_simple(y, (1,), "sum", "float32")
    b.output(b.map(lambda a, c: E.binary("div", a, c), y, b.reshape(s, (4, 1)), dtype="float32"))
    device, plan, program = instantiate(b.graph)
    assert plan.buffer("arena").size == 4 * 8 * 4
    program.run({"x": RNG.standard_normal((4, 8)).astype(np.float32)})
    first, second = device.dispatched()
    assert first[2] == (("input:x", 0, 128), ("arena", 0, 128))
    assert second[2] == (("arena", 0, 128), ("out0", 0, 128))
    assert len(device.compiled) == 2


def test_matmul_chain_alternates_between_two_arena_slots_with_one_pipeline():
    """x w0 w1 w2 w3: four dispatches of one kernel (the same shapes), each reading the product before it; the three
    intermediates take two arena slots, as no more than two are live at once."""
    b = GraphBuilder()
    y = b.input("x", (32, 32), "float32")
    for i in range(4):
        y = b.matmul(y, b.input(f"w{i}", (32, 32), "float32"))
    b.output(y)
    device, plan, program = instantiate(b.graph)
    slot = 32 * 32 * 4
    assert plan.stats["unplanned_bytes"] == 3 * slot and plan.buffer("arena").size == 2 * slot
    program.run({name: RNG.standard_normal((32, 32)).astype(np.float32) for name in ("x", "w0", "w1", "w2", "w3")})
    dispatched = device.dispatched()
    assert len(dispatched) == 4 and len(device.compiled) == 1
    assert {kernel for kernel, _, _ in dispatched} == {device.compiled[0][2]}
    writes = [bindings[-1] for _, _, bindings in dispatched]
    reads = [bindings[0] for _, _, bindings in dispatched]
    assert reads == [("input:x", 0, slot)] + writes[:-1]
    assert [w[0] for w in writes] == ["arena", "arena", "arena", "out0"]
    assert writes[0] != writes[1] and writes[0] == writes[2]
    assert [bindings[1] for _, _, bindings in dispatched] == [(f"input:w{i}", 0, slot) for i in range(4)]


def test_torch_model_plan_binds_its_params_and_replays():
    """Linear, ReLU, Linear, Softmax traced from torch (params as placeholders): three kernels (the bias and the
    ReLU run in the first product's kernel), each compiled as soon as it is generated; the products bind the uploaded
    weight and bias buffers, each later dispatch reads what the one before wrote, and a second run replays the same
    dispatches. New weights uploaded go into new buffers, which the next run binds."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_meganeura.lower.decompositions import decomposition_table
    from torch_meganeura.backend.device_graph import compile_device_graph, feed, program_for

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.Softmax(-1))
    names = [name for name, _ in model.named_parameters()]

    def forward(*args):
        return torch.func.functional_call(model, dict(zip(names, args[:-1])), (args[-1],))

    example = [p.detach() for p in model.parameters()] + [torch.randn(4, 16)]
    gm = make_fx(forward, decomposition_table=decomposition_table())(*example)
    device = RecordingDevice()
    graph = compile_device_graph(gm, example, set(range(len(names))), device)
    assert [d.label.split()[0] for d in graph.plan.dispatches] == ["addmm", "addmm", "softmax"]
    assert len(device.compiled) == 3
    program = program_for(graph, device)
    assert len(device.compiled) == 3
    params = {name: example[i].numpy() for i, name in graph.lowered.params}
    program.upload_params(params)
    host, _ = feed(graph.lowered, example, device)
    program.run(host)
    first = device.dispatched()
    assert [bindings[1:3] for _, _, bindings in first[:2]] == [
        (("param:arg0", 0, 2048), ("param:arg1", 0, 128)), (("param:arg2", 0, 1024), ("param:arg3", 0, 32))]
    assert first[0][2][0] == ("input:arg4", 0, 256) and first[-1][2][-1] == ("out0", 0, 128)
    assert first[1][2][0] == first[0][2][-1] and first[2][2][0] == first[1][2][-1]
    program.run(host)
    assert device.dispatched() == first * 2
    old = [buffer for buffer in device.buffers if buffer.label.startswith("param:")]
    program.upload_params(params)
    program.run(host)
    used = [r[0] for d in device.submits[-1].dispatches for r in d.group.ranges if r[0].label.startswith("param:")]
    assert len(used) == 4 and not any(buffer in old or buffer.destroyed for buffer in used)
    assert len(old) == 4 and all(buffer.destroyed for buffer in old)
