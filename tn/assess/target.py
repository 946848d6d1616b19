# What `tn assess` measures: load a TARGET (file.py:factory or a Hugging Face class + config) into a model and inputs.
"""Loading the model to assess.

Two kinds of TARGET:

* ``path/to/file.py:factory``: the file is imported as a module and
  ``factory()`` must return ``(model, example_inputs)``; ``example_inputs``
  is a tensor, a tuple/list of positional arguments, or a dict of keyword
  arguments.
* a Hugging Face model class (``GPT2LMHeadModel``, ``transformers:LlamaForCausalLM``)
  with ``hf_config`` the path of a local ``config.json`` (random weights:
  nothing is downloaded). Without a class name the config's
  ``architectures[0]`` is used. Inputs follow the model's head:
  causal LM (``...ForCausalLM``, ``...LMHeadModel``): random token ids;
  sequence classification: ids and labels; image models (config with
  ``num_channels``): pixel values (and labels for classification heads).

Every failure is an :class:`AssessError` whose message says what was wrong
and what to do (the CLI prints it and exits 2).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import TnError

__all__ = ["AssessError", "Target", "load_target", "load_file_factory", "load_hf", "hf_inputs", "user_frame",
           "check_inputs"]


class AssessError(TnError, ValueError):
    """The assessment could not start: bad TARGET, factory failure, wrong inputs (a ValueError; the message says
    what to do)."""


@dataclass
class Target:
    """A model ready to assess: ``model``, ``inputs`` (tuple of positional args), ``kwargs``, a ``label``."""

    model: torch.nn.Module
    inputs: tuple
    kwargs: dict
    label: str
    source_file: Optional[str] = None   # the file defining the model's classes (imported again by spawned doors)


_TN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__))


def _is_library(filename: str) -> bool:
    if filename.startswith("<"):   # generated code (<string>, FX's <eval_with_key>)
        return True
    return os.path.abspath(filename).startswith((_TN_DIR + os.sep, _TORCH_DIR + os.sep, _STDLIB_DIR + os.sep))


def user_frame(frames) -> Optional[str]:
    """``file:line`` of the innermost frame of ``frames`` (``traceback.extract_tb``/``extract_stack``) that is
    neither tn, torch nor the standard library: the user's line (or the model library's, e.g. transformers)."""
    for fr in reversed(list(frames)):
        if not _is_library(fr.filename):
            return f"{fr.filename}:{fr.lineno}"
    return None


def _error_text(exc: BaseException) -> str:
    where = user_frame(traceback.extract_tb(exc.__traceback__))
    return f"{type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")


def import_file(path: str) -> Any:
    """Import the Python file ``path`` as module ``tn_assess_target_<stem>`` (registered in ``sys.modules``, so
    its classes pickle by that name; its folder joins ``sys.path``)."""
    mod_name = "tn_assess_target_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    if mod_name in sys.modules and getattr(sys.modules[mod_name], "__file__", None) == os.path.abspath(path):
        return sys.modules[mod_name]
    s = importlib.util.spec_from_file_location(mod_name, os.path.abspath(path))
    module = importlib.util.module_from_spec(s)
    sys.modules[mod_name] = module
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        s.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    return module


def load_file_factory(spec: str) -> Target:
    """Import ``path/to/file.py`` and call its ``factory`` (``spec`` is ``path:factory``)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise AssessError(f"TARGET {spec!r}: expected path/to/file.py:factory (a function returning model and "
                          f"example inputs), or a Hugging Face model class with --hf-config config.json")
    if not os.path.isfile(path):
        raise AssessError(f"TARGET {spec!r}: no file {path!r}")
    try:
        module = import_file(path)
    except Exception as e:  # noqa: BLE001  (any error of the user's file becomes a message)
        raise AssessError(f"TARGET {spec!r} does not import: {_error_text(e)}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise AssessError(f"TARGET {spec!r}: {path} has no function {name!r} "
                          f"(it defines: {', '.join(n for n in vars(module) if not n.startswith('_'))})")
    try:
        made = factory()
    except Exception as e:  # noqa: BLE001
        raise AssessError(f"TARGET {spec!r}: the factory raised {_error_text(e)}") from None
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise AssessError(f"TARGET {spec!r}: the factory returned {type(made).__name__}; it must return "
                          f"(model, example_inputs)")
    model, inputs = made
    args, kwargs = check_inputs(model, inputs, f"TARGET {spec!r}")
    return Target(model, args, kwargs, spec, os.path.abspath(path))


def check_inputs(model: Any, inputs: Any, where: str) -> tuple:
    """``(args, kwargs)`` from ``inputs`` (tensor, tuple/list or dict); :class:`AssessError` naming what is
    wrong otherwise (``model`` must be an ``nn.Module``, the inputs must hold at least one tensor)."""
    if not isinstance(model, torch.nn.Module):
        raise AssessError(f"{where}: the model is a {type(model).__name__}, not a torch.nn.Module")
    if isinstance(inputs, torch.Tensor):
        args, kwargs = (inputs,), {}
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    elif isinstance(inputs, dict):
        args, kwargs = (), dict(inputs)
    else:
        raise AssessError(f"{where}: example inputs are a {type(inputs).__name__}; give a tensor, a tuple of "
                          f"positional arguments or a dict of keyword arguments")
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    if not any(isinstance(t, torch.Tensor) for t in leaves):
        raise AssessError(f"{where}: example inputs hold no tensor ({type(inputs).__name__} of "
                          f"{', '.join(sorted({type(t).__name__ for t in leaves})) or 'nothing'})")
    bad = [t for t in leaves if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
    if bad:
        raise AssessError(f"{where}: example inputs must be CPU tensors (found one on {bad[0].device}); "
                          f"tn assess moves them to each door itself")
    return args, kwargs


def _head(cls_name: str, config: Any) -> str:
    if cls_name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal_lm"
    if cls_name.endswith("ForSequenceClassification"):
        return "seq_cls"
    if getattr(config, "num_channels", None) is not None:
        return "image_cls" if cls_name.endswith("ForImageClassification") else "vision"
    return "base"


def hf_inputs(model: Any, cls_name: str, batch: int, seq: int, train: bool, seed: int = 0) -> dict:
    """Keyword inputs for a HF model by its head (see the module docstring), drawn from a seeded generator."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    head = _head(cls_name, cfg)
    if head in ("vision", "image_cls"):
        size = getattr(cfg, "image_size", 224)
        size = size[0] if isinstance(size, (list, tuple)) else size
        kw = {"pixel_values": torch.randn(batch, cfg.num_channels, size, size, generator=g)}
        if head == "image_cls" and train:
            kw["labels"] = torch.randint(0, cfg.num_labels, (batch,), generator=g)
        return kw
    vocab = getattr(cfg, "vocab_size", None)
    if not vocab:
        raise AssessError(f"{cls_name}: cannot make inputs (the config has no vocab_size and no num_channels); "
                          f"use a path/to/file.py:factory TARGET that returns the inputs")
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    kw = {"input_ids": ids}
    if head == "causal_lm" and train:
        kw["labels"] = ids.clone()
    if head == "seq_cls":
        kw["labels"] = torch.randint(0, cfg.num_labels, (batch,), generator=g)
    if head == "causal_lm":
        kw["use_cache"] = False
    return kw


def load_hf(class_name: Optional[str], config_path: str, batch: int = 1, seq: int = 128, train: bool = False,
            seed: int = 0) -> Target:
    """A HF model of ``class_name`` (``None``: the config's ``architectures[0]``) from a local config, random
    weights (seeded), dropout off, and inputs for its head."""
    try:
        import transformers  # lazy: heavy optional dependency, only for a Hugging Face model id target
    except ImportError:
        raise AssessError("--hf-config needs the transformers package (pip install transformers)") from None
    if not os.path.isfile(config_path):
        raise AssessError(f"--hf-config {config_path!r}: no such file")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise AssessError(f"--hf-config {config_path!r} is not a JSON config: {e}") from None
    if class_name and ":" in class_name:
        class_name = class_name.rpartition(":")[2]
    if not class_name:
        archs = raw.get("architectures") or []
        if not archs:
            raise AssessError(f"--hf-config {config_path!r} names no architectures; give the model class as TARGET "
                              f"(e.g. GPT2LMHeadModel)")
        class_name = archs[0]
    cls = getattr(transformers, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise AssessError(f"TARGET {class_name!r} is not a model class of transformers "
                          f"(e.g. GPT2LMHeadModel, LlamaForCausalLM, ResNetForImageClassification)")

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        config = cls.config_class.from_json_file(config_path)
        for k, v in list(config.to_dict().items()):   # the comparison needs deterministic forward passes
            if isinstance(v, float) and ("dropout" in k or "pdrop" in k):
                setattr(config, k, 0.0)
        torch.manual_seed(seed)
        model = cls(config)
    except Exception as e:  # noqa: BLE001
        raise AssessError(f"{class_name} from {config_path}: building the model raised {_error_text(e)}") from None
    kwargs = hf_inputs(model, class_name, batch, seq, train, seed)
    return Target(model, (), kwargs, f"{class_name} ({os.path.basename(config_path)})")


def load_target(target: Optional[str], hf_config: Optional[str] = None, batch: int = 1, seq: int = 128,
                train: bool = False) -> Target:
    """The :class:`Target` the CLI's ``TARGET`` / ``--hf-config`` name."""
    if hf_config:
        return load_hf(target, hf_config, batch, seq, train)
    if not target:
        raise AssessError("give a TARGET: path/to/file.py:factory, or a Hugging Face model class with "
                          "--hf-config config.json")
    return load_file_factory(target)
