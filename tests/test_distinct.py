"""Example inputs that share memory are captured as distinct inputs (pipesplit.distinct, issue 38 #1)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit.distinct import distinct_inputs
from tests.close import assert_close, assert_grads_close, assert_tree_close
from tests.training import accumulate, accumulate_tree, dot_loss, make_target


class Pair(nn.Module):
    """Reads its two inputs differently, so reading one for both is visible."""

    def __init__(self, d: int = 6):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, y):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * torch.sigmoid(y)


class Labels(Pair):
    """The Hugging Face idiom: ``model(ids, labels=ids)``."""

    def forward(self, x, labels=None):
        h = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return h, ((h - labels) ** 2).mean(-1)


class Tree(Pair):
    """A pytree input ``{"x": t, "pair": (t, t)}``."""

    def forward(self, batch):
        x, (p, q) = batch["x"], batch["pair"]
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * p - q


class Sliced(Pair):
    """The second input is a view: ``(x, x[:, :, :3])`` in the example."""

    def __init__(self, d: int = 6):
        super().__init__(d)
        self.d = nn.Linear(3, d)

    def forward(self, x, y):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.d(y)


class Transposed(Pair):
    """The second input is a transposed view: ``(x, x.transpose(1, 2))`` of a (B, 6, 6) example."""

    def forward(self, x, y):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) @ y


def _args(form: str, t: torch.Tensor, u: torch.Tensor) -> tuple[tuple, dict]:
    """The call of ``form`` built from ``t`` (and ``u`` where the example passes ``t`` twice)."""
    return {
        "positional": ((t, u), {}),
        "kwarg": ((t,), {"labels": u}),
        "pytree": (({"x": t, "pair": (u, u * 0.5 + 1 if u is not t else u)},), {}),
        "slice": ((t, u[:, :, :3]), {}),
        "transpose": ((t, u.transpose(1, 2)), {}),
    }[form]


MODELS = {"positional": Pair, "kwarg": Labels, "pytree": Tree, "slice": Sliced, "transpose": Transposed}
FORMS = list(MODELS)


def _compiled(form: str, dynamic: bool) -> tuple[nn.Module, pipesplit.SplitProgram]:
    torch.manual_seed(0)
    model = MODELS[form]()
    x = torch.randn(4, 6, 6)
    args, kwargs = _args(form, x, x)
    prog = pipesplit.compile(model, args, example_kwargs=kwargs, num_stages=2, dynamic_batch=dynamic,
                             progress=False)
    return model, prog


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_the_same_tensor_as_two_example_inputs_is_read_from_each_argument(form, dynamic):
    """``compile(model, (x, x))`` then ``prog(a, b)`` is ``model(a, b)``, not ``model(b, b)``: torch.export
    folded the two inputs into one, at the example's batch and at a new one (the re-capture)."""
    model, prog = _compiled(form, dynamic)
    for batch in (4, 8):  # 8: a static capture captures again, from the same aliased example
        a, b = torch.randn(batch, 6, 6), torch.randn(batch, 6, 6)
        args, kwargs = _args(form, a, b)
        assert_tree_close(prog(*args, **kwargs), model(*args, **kwargs), name=f"{form} outputs at batch {batch}")
    placeholders = [n for n in prog.captured_gm.graph.nodes if n.op == "placeholder"]
    assert all(n.users for n in placeholders), "every input is read"


@pytest.mark.parametrize("form", FORMS)
def test_a_pipeline_over_aliased_example_inputs_trains_on_each_input(form):
    """``Pipeline.step`` on distinct inputs gives the plain model's loss, parameter gradients and input
    gradients, at the example's batch and at a new batch size."""
    model, prog = _compiled(form, False)
    ref = copy.deepcopy(model)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    for step, batch in enumerate((8, 4)):  # microbatches of 4 (as captured), then of 2 (captured again)
        a, b = torch.randn(batch, 6, 6, requires_grad=True), torch.randn(batch, 6, 6, requires_grad=True)
        a_ref, b_ref = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        args, kwargs = _args(form, a, b)
        args_ref, kwargs_ref = _args(form, a_ref, b_ref)
        with torch.no_grad():
            target = make_target(ref(*args_ref, **kwargs_ref))
        want = accumulate_tree(ref, args_ref, kwargs_ref, target, 2)
        assert_close(pipe.step(*args, target=target, **kwargs), want, name=f"loss at step {step}")
        assert_grads_close(pipe.named_parameters(), ref)
        for name, got, expected in [("a", a, a_ref), ("b", b, b_ref)]:
            assert got.grad is not None, f"no gradient for input {name} at step {step}"
            assert_close(got.grad, expected.grad, name=f"gradient of input {name} at step {step}")


def test_the_same_tensor_passed_twice_at_run_time_gets_both_gradients():
    """Distinct at capture, the program still takes one tensor for both: its gradient is the sum."""
    model, prog = _compiled("positional", False)
    ref = copy.deepcopy(model)
    pipe = pipesplit.Pipeline(prog, "gpipe", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    x = torch.randn(4, 6, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    target = make_target(ref(x_ref, x_ref).detach())
    assert_close(pipe.step(x, x, target=target), accumulate(ref, (x_ref, x_ref), {}, target, 2))
    assert_close(x.grad, x_ref.grad, name="gradient of the input given twice")


def test_distinct_inputs_copies_only_the_later_aliases_and_leaves_the_users_objects_alone():
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    example = {"x": x, "pair": [x, x[:, :2]], "w": w}
    (tree,), kwargs, copied = distinct_inputs((example,), {"labels": w})
    assert copied == ["args[0]['pair'][0]", "args[0]['pair'][1]", "kwargs['labels']"]
    assert tree["x"] is x and tree["w"] is w, "the first of each stays the user's"
    assert tree["pair"][0] is not x and torch.equal(tree["pair"][0], x) and tree["pair"][0].requires_grad
    assert tree["pair"][1].shape == (3, 2) and torch.equal(tree["pair"][1], x[:, :2])
    assert tree["pair"][1].untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert kwargs["labels"] is not w and torch.equal(kwargs["labels"], w)
    assert example["pair"][0] is x and example["pair"][1]._base is x, "the user's containers are unchanged"
    args = (torch.randn(2), torch.randn(2))
    assert distinct_inputs(args, {})[0] is args, "nothing shared: the same objects back"


def test_the_hugging_face_idiom_labels_equal_to_ids_reads_the_labels_given():
    """``compile(model, ids, example_kwargs={"labels": ids})`` then ``prog(a, labels=b)`` returned
    ``model(b, labels=b)``'s loss (issue 38: 4.169848 where the model gives 4.173154)."""
    pytest.importorskip("transformers")
    from tests.zoo import hf_gpt2

    torch.manual_seed(0)
    model = hf_gpt2().eval()
    ids = torch.randint(0, 128, (2, 16))
    prog = pipesplit.compile(model, ids, example_kwargs={"labels": ids}, num_stages=2, progress=False)
    a, b = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
    got, want = prog(a, labels=b), model(a, labels=b)
    assert_close(got["loss"], want.loss, name="loss")
    assert_close(got["logits"], want.logits, name="logits")


def test_inputs_without_storage_to_compare_are_told_apart_by_identity():
    meta = torch.empty(2, 3, device="meta")
    (a, b, c), _, copied = distinct_inputs((meta, meta, torch.empty(2, 3, device="meta")), {})
    assert a is meta and b is not meta and b.is_meta and c.is_meta and copied == ["args[1]"]
