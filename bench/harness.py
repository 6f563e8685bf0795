"""Section ``harness``: the challenge's own check and timing (wall clock over 1000 x up, gate, down
with a sync after each, summed over its three options), contenders in interleaved rounds beside a
floor fx that only allocates and launches an empty kernel. Rows ``harness`` (seconds)."""

import statistics
import time

import torch
import triton
from tqdm import tqdm  # text bars: a saved notebook shows their last state; a widget bar needs a live kernel

import bench.contenders
import bench.results
from nf4_triton import fastpath, kernel

HARNESS_ROUNDS_PER_ROUND = 3  # harness rounds per round of the other sections
HARNESS_OPTIONS = [
    (2, 3333, 2048, 8192, 3407, torch.float16),
    (5, 777, 1024, 4096, 3409, torch.bfloat16),
    (3, 2048, 4096, 14336, 3408, torch.bfloat16),
]
HARNESS_FLOOR = "floor (alloc + empty launch)"


def harness_layers(hd, m, seed, dtype):
    """The challenge's MLP: gate, up (hd -> m) and down (m -> hd) Linear4bit layers on CUDA."""
    import bitsandbytes as bnb
    from transformers import set_seed

    set_seed(seed)
    torch.set_default_dtype(torch.float32)
    layers = {name: bnb.nn.Linear4bit(fan_in, fan_out, bias=None, compute_dtype=dtype, compress_statistics=True,
                                      quant_type="nf4").cuda()
              for name, (fan_in, fan_out) in (("gate", (hd, m)), ("up", (hd, m)), ("down", (m, hd)))}
    for layer in layers.values():
        layer.weight.quant_state.dtype = dtype
    return layers


def challenge_check(fx, option, fast_dequantize=None):
    """The harness's warm-up checks for one option (challenge.md), twice; raises on a mismatch.
    Returns the largest |output| (finite when the forward is sane)."""
    bsz, qlen, hd, m, seed, dtype = option
    layers = harness_layers(hd, m, seed, dtype)
    X = torch.randn((bsz, qlen, hd), device="cuda", dtype=dtype)
    silu = torch.nn.functional.silu
    for _ in range(2):
        expected = layers["down"](silu(layers["gate"](X)) * layers["up"](X))
        up = X @ fx(layers["up"]).t()
        gate = X @ fx(layers["gate"]).t()
        got = (silu(gate) * up) @ fx(layers["down"]).t()
        torch.testing.assert_close(got, expected, check_stride=True)
        assert got.dtype == dtype
        for layer in layers.values():
            state = layer.weight.quant_state
            assert layer.weight.dtype == torch.uint8 and state.absmax.dtype == torch.uint8
            assert state.code.dtype == torch.float32 and state.offset.dtype == torch.float32
            assert state.blocksize == 64 and state.state2.blocksize == 256
            assert state.state2.absmax.dtype == torch.float32 and state.state2.code.dtype == torch.float32
            if fast_dequantize is not None:
                assert torch.equal(fx(layer).t(), fast_dequantize(layer.weight, state).t())
    return got.float().abs().max().item()


def harness_seconds(fx, options_layers, iterations=1000):
    """The challenge's timing: wall clock over 1000 x (up, sync, gate, sync, down, sync), summed."""
    total = 0.0
    for layers in options_layers:
        up, gate, down = layers["up"], layers["gate"], layers["down"]
        torch.cuda.synchronize()
        start = time.time()
        for _ in range(iterations):
            fx(up)
            torch.cuda.synchronize()
            fx(gate)
            torch.cuda.synchronize()
            fx(down)
            torch.cuda.synchronize()
        total += time.time() - start
    return total


@triton.jit
def _empty_kernel(
    packed_ptr,  # the packed weight's place in a plan's launch, unread
    out_ptr,  # the freshly allocated output, left untouched
):
    pass


def harness_floor():
    """An fx for the harness that allocates the output with ``torch.empty`` and launches an empty
    kernel through the launcher the launch plans use: the host path every dequantizer pays, with
    no kernel time."""
    first_out = torch.empty(1, device="cuda")
    compiled = _empty_kernel[(1,)](first_out, first_out)
    pointer = first_out.data_ptr()
    launch = fastpath.kernel_launcher(compiled, 1, (pointer, pointer), (0, 1),
                                      torch._C._cuda_getCurrentRawStream(first_out.device.index))

    def fx(layer):
        state = layer.weight.quant_state
        # torch.empty, where plans allocate through Inductor's entry (2.1 against 5.0 us per call, NOTES.md item 57)
        out = torch.empty(size=state.shape, dtype=state.dtype, device="cuda")
        launch(torch._C._cuda_getCurrentRawStream(out.device.index), pointer, out.data_ptr())
        return out

    return fx


def run(rounds, meta, log):
    """The challenge harness in interleaved rounds; rows hold seconds, ratios are printed. The
    floor instrument runs in the same rounds: ours minus the floor is our kernel time plus
    whatever host time we spend beyond the floor."""
    funcs = {"nf4-triton": kernel.your_dequantize_nf4}
    for name, fn in bench.contenders.unsloth_functions(log).items():
        funcs[name] = lambda layer, fn=fn: fn(layer.weight, layer.weight.quant_state)
    funcs[HARNESS_FLOOR] = harness_floor()
    options_layers = [harness_layers(hd, m, seed, dtype) for _, _, hd, m, seed, dtype in HARNESS_OPTIONS]
    for fx in funcs.values():
        harness_seconds(fx, options_layers, iterations=20)  # warm-up: compile, plans, clocks
    samples = {name: [] for name in funcs}
    for round_index in tqdm(range(rounds), desc="harness rounds"):
        for name in list(funcs) if round_index % 2 == 0 else reversed(funcs):  # no contender always first
            samples[name].append(harness_seconds(funcs[name], options_layers))
        log(f"harness round {round_index + 1}: " + ", ".join(f"{n} {s[-1]:.3f} s" for n, s in samples.items()))
    rows = [bench.results.seconds_row(meta, "harness", "3 options", "fp16+bf16", name, times)
            for name, times in samples.items()]
    ours = statistics.median(samples["nf4-triton"])
    log(f"harness: ours {ours:.3f} s, {HARNESS_FLOOR} {statistics.median(samples[HARNESS_FLOOR]):.3f} s")
    for name, times in samples.items():
        if name not in ("nf4-triton", HARNESS_FLOOR):
            ratios = sorted(t / o for t, o in zip(times, samples["nf4-triton"]))
            log(f"harness speedup vs {name}: median of medians {statistics.median(times) / ours:.2f}x, "
                f"per-round ratios {ratios[0]:.2f}..{ratios[-1]:.2f}")
    return rows
