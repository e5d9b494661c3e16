"""A cache flag in a nested config (Llava's ``config.text_config.use_cache``) is turned off for the
capture only: the model compiles, and the user's model and config are unchanged afterwards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit.errors import CaptureError
from pipesplit.kv_cache import configs_asking_for_cache


class Cache:
    """Stands in for transformers' DynamicCache: not a tensor, not a pytree, so no stage can carry it."""

    def __init__(self, h: torch.Tensor):
        self.h = h


class Multimodal(nn.Module):
    """Reads the cache flag from ``config.text_config`` and takes ``use_cache`` only via ``**kwargs``."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(text_config=SimpleNamespace(use_cache=True, hidden=8), vision_config=None)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, **kwargs):
        h = self.b(torch.relu(self.a(x)))
        use_cache = kwargs.get("use_cache", self.config.text_config.use_cache)
        return (h, Cache(h)) if use_cache else h


class Named(Multimodal):
    """Names ``use_cache`` in its signature: pipesplit passes ``use_cache=False`` instead."""

    def forward(self, x: torch.Tensor, use_cache: bool | None = None):  # type: ignore[override]
        return super().forward(x, **({} if use_cache is None else {"use_cache": use_cache}))


def test_the_nested_flag_is_found():
    config = SimpleNamespace(use_cache=False, text_config=SimpleNamespace(use_cache=True),
                             vision_config=SimpleNamespace(use_cache=False))
    assert [p for p, _ in configs_asking_for_cache(config)] == ["config.text_config"]
    assert configs_asking_for_cache(SimpleNamespace(use_cache=False)) == []


@pytest.mark.parametrize("cls", [Multimodal, Named])
def test_a_nested_cache_flag_compiles_and_is_put_back(cls):
    torch.manual_seed(0)
    model = cls()
    with pytest.raises(Exception):  # the model as configured returns a cache object
        torch.export.export(model, (torch.randn(2, 8),))
    prog = pipesplit.compile(model, torch.randn(2, 8), num_stages=2, progress=False)
    assert model.config.text_config.use_cache is True, "compiling must not change the user's config"
    assert any("config.text_config.use_cache" in n for n in prog.notes), prog.notes
    x = torch.randn(3, 8)
    torch.testing.assert_close(prog(x), model(x, use_cache=False), rtol=0, atol=0)


def test_a_caller_who_asks_for_the_cache_keeps_it():
    model = Multimodal()
    with pytest.raises(CaptureError):
        pipesplit.compile(model, torch.randn(2, 8), example_kwargs={"use_cache": True}, num_stages=2)
    assert model.config.text_config.use_cache is True


def test_the_flag_is_put_back_when_the_capture_fails():
    class Failing(Multimodal):
        def forward(self, x: torch.Tensor, **kwargs):
            if x.sum() > 0:  # data-dependent: torch.export refuses it
                return x
            return super().forward(x, **kwargs)

    model = Failing()
    with pytest.raises(CaptureError):
        pipesplit.compile(model, torch.randn(2, 8), num_stages=2)
    assert model.config.text_config.use_cache is True


class Wrapper(nn.Module):
    """The usual wrapper around a Hugging Face LM: ``self.lm(ids).logits``, no ``use_cache`` anywhere."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids).logits


def test_a_wrapped_hugging_face_model_is_captured_without_its_cache():
    """Its config asked for a cache the wrapper drops: the graphs held the cache's in-place ops, so
    compile= ran every stage eager, warning about aten.detach_ and not the cache."""
    from tests.zoo import CASE_BY_NAME

    torch.manual_seed(0)
    model = Wrapper(CASE_BY_NAME["hf_gpt2"].build())
    model.lm.config.use_cache = True  # Hugging Face's default (the zoo builds it off)
    ids = torch.randint(0, 128, (2, 16))
    prog = pipesplit.compile(model, ids, num_stages=2, progress=False)
    assert model.lm.config.use_cache is True, "compiling must not change the user's config"
    assert any("lm.config.use_cache" in n for n in prog.notes), prog.notes
    writes = [n for s in prog.stages for n in s.module.graph.nodes
              if n.op == "call_function" and str(n.target).endswith("_.default")]
    assert not writes, writes
    x = torch.randint(0, 128, (3, 16))
    torch.testing.assert_close(prog(x), model(x), rtol=0, atol=0)


class _BlockConfig:
    use_cache = True  # this model's own flag: its blocks return their keys


class KeepsKeys(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = None
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        for block in self.blocks:
            block.config = _BlockConfig()  # type: ignore[assignment]

    def forward(self, x: torch.Tensor):
        keys = []
        for block in self.blocks:
            x = block(x)
            if block.config.use_cache:  # type: ignore[union-attr]
                keys.append(x)
        return x, keys


def test_a_submodules_own_use_cache_is_left_alone():
    """Turning off every submodule's config.use_cache emptied this model's key list (review of this change):
    below the root only Hugging Face models' configs are switched."""
    torch.manual_seed(0)
    model = KeepsKeys()
    prog = pipesplit.compile(model, torch.randn(2, 8), num_stages=2, progress=False)
    x = torch.randn(3, 8)
    got, want = prog(x), model(x)
    assert len(got[1]) == len(want[1]) == 2 and not any("use_cache" in n for n in prog.notes), prog.notes


def test_the_cache_note_is_printed_once_by_the_cli(tmp_path, capsys, monkeypatch):
    """The note went to the log (shown by the CLI) and into the report's notes: twice per `pipesplit split`."""
    from pipesplit.cli import main

    (tmp_path / "named_model.py").write_text(
        "from tests.test_kv_cache import Named\n\ndef build():\n    return Named()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["split", str(tmp_path / "named_model.py") + ":build", "--input-shape", "2x8", "--stages", "2"]) == 0
    out, err = capsys.readouterr()
    assert (out + err).count("asks for a KV cache") == 1, out + err
