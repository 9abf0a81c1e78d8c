"""--offload_activations on CPU (models/offload.py): what the forward saves for the backward pass goes to the host
buffers and comes back unchanged, each large tensor in a buffer of its exact size, reused from micro-batch to
micro-batch. Pinning needs a GPU (cudaHostRegister): here the buffers are the same copies, unpinned; the plan gpu-tests
of benchmarks/run_device.sh runs the pinned case."""

from __future__ import annotations

import pytest
import torch
from conftest import gpu_count, run_python_on_gpus

from model_utils.models.offload import HostActivations


def _tiny_model():
    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.models.build import build_model, model_config

    torch.manual_seed(0)
    model = build_model("tiny", model_config("tiny", load_tokenizer(None)), torch.float32, "sdpa", True)
    model.train()
    return model


def test_offloaded_activations_are_the_recomputed_layers_inputs():
    """Through torch's saved-tensor hooks: with --gradient_checkpointing, each decoder layer's input among what the
    forward saves (torch's checkpoint saves it as a tensor of the graph), and no layer's working set."""
    from model_utils.models.build import checkpointable_layers

    model = _tiny_model()
    tokens = torch.randint(0, 500, (2, 32))
    inputs, saved = [], []
    for layer in checkpointable_layers(model):
        layer.register_forward_pre_hook(lambda module, args, kwargs: inputs.append(
            (args[0] if args else kwargs["hidden_states"]).data_ptr()), with_kwargs=True)

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    first_pass = inputs[:4]  # the backward pass recomputes each layer: those calls come after
    assert len(first_pass) == 4 and set(first_pass) <= {t.data_ptr() for t in saved}
    hidden_sized = [t for t in saved if tuple(t.shape) == (2, 32, 192)]
    assert len(hidden_sized) <= 4 + 3  # the layers' inputs, the final norm's and the head's: no layer's working set


def _step(model, tokens, offload):
    model.zero_grad()
    context = offload.saving() if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with context:
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("pooled_bytes", [0, 4096])
def test_the_host_buffers_give_back_the_same_loss_and_gradients_and_are_reused(pooled_bytes):
    """Every saved tensor (pooled_bytes 0), or those of 4 KiB and up (the rest as save_on_cpu takes them), in buffers of
    their exact size: the loss and every gradient equal those of a run without the offload, bitwise; the second and
    third micro-batches allocate nothing (each tensor finds its size free again once the backward pass released it);
    a new shape releases the buffers of the old."""
    model = _tiny_model()
    tokens = torch.randint(0, 500, (2, 32))
    want_loss, want_grads = _step(model, tokens, None)
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=tokens, labels=tokens).loss.backward()
    pooled = [n for n in sizes if n and n >= pooled_bytes]  # an empty tensor goes the small way
    assert len(pooled) > 4 and (pooled_bytes == 0 or len(pooled) < len(sizes))

    offload = HostActivations(pinned=False, pooled_bytes=pooled_bytes)
    for _ in range(3):
        loss, grads = _step(model, tokens, offload)
        assert torch.equal(loss, want_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads, strict=True))
        assert offload.allocations == len(pooled)  # the first micro-batch's; none after
        assert offload.held_bytes == sum(pooled)  # exact sizes, no rounding
    _step(model, tokens[:, :16], offload)  # a shorter sequence: its sizes, the old ones released at its first miss
    assert offload.held_bytes < sum(pooled)


def test_a_buffer_serves_the_next_tensor_only_after_the_backward_pass_released_it():
    """Within one forward, two live tensors of one size get two buffers; once the first is released, the next tensor
    of its size takes its buffer, and a different size releases the free ones."""
    offload = HostActivations(pinned=False, pooled_bytes=0)
    a, b = (torch.randn(64, requires_grad=True) for _ in range(2))
    with offload.saving():
        y = (a * b).sum()  # saves a and b: 256 bytes each
    assert offload.allocations == 2 and offload.held_bytes == 512
    y.backward()
    del y  # the graph, and with it the saved tensors
    with offload.saving():
        z = (a * 2.0).exp().sum()  # saves one tensor of 256 bytes: a free buffer
    assert offload.allocations == 2
    del z
    with offload.saving():
        w = torch.randn(16, requires_grad=True).exp().sum()  # 64 bytes: a miss; the free 256-byte buffers go
    assert offload.allocations == 3 and offload.held_bytes == 64
    del w


class _ReturnsItsSavedGradient(torch.autograd.Function):
    """As Liger's fused loss does where the loss's gradient is 1: the backward returns a tensor it saved."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.detach() + 2.0)
        return (2 * x).sum()

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        return saved


def test_a_gradient_returned_from_a_saved_tensor_outlives_the_buffers_reuse():
    """On CPU the copy back is a copy too: a gradient that is the saved tensor itself keeps its values when the next
    micro-batch's forward writes into the buffer it came from."""
    offload = HostActivations(pinned=False, pooled_bytes=0)
    x = torch.zeros(64, requires_grad=True)
    with offload.saving():
        loss = _ReturnsItsSavedGradient.apply(x)
    loss.backward()
    del loss
    with offload.saving():
        _ReturnsItsSavedGradient.apply(torch.full((64,), 5.0, requires_grad=True))  # the same size: that buffer
    assert offload.allocations == 1 and torch.equal(x.grad, torch.full((64,), 2.0))


PINNED_CHECK = """
import torch
from model_utils.models.offload import HostActivations
offload = HostActivations(pinned=True, pooled_bytes=1024**2)
x = torch.randn(3 * 1024**2 + 5, device="cuda", requires_grad=True)  # 12 MiB + 20 bytes: no power of two
for _ in range(2):
    with offload.saving():
        y = (x * 3).exp().sum()  # saves exp's output, one tensor of 12 MiB
    y.backward()
    assert torch.equal(x.grad, 3 * (x.detach() * 3).exp())
    x.grad = None
    del y
assert offload.allocations == 1 and offload.held_bytes == x.numel() * 4
(buffer,) = offload.free[x.numel() * 4]
assert buffer.pinned and buffer.data.is_pinned() and buffer.data.numel() == x.numel() * 4
print("pinned ok")
"""


@pytest.mark.skipif(gpu_count() == 0, reason="pinning host memory needs a GPU (benchmarks/run_device.sh gpu-tests)")
def test_pinned_buffers_are_registered_at_their_exact_size_and_copy_back_exactly():
    """On a GPU (the session hides them: a subprocess with them visible): a buffer pinned at its tensor's exact size,
    the gradient through it exact, the second step on the same buffer."""
    done = run_python_on_gpus(PINNED_CHECK)
    assert done.returncode == 0 and "pinned ok" in done.stdout, done.stderr[-2000:]
