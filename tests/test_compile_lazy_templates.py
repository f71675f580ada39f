"""Inductor's kernel templates compiled at their first use: the same template, later."""

from __future__ import annotations

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
jinja2 = pytest.importorskip("jinja2")

from ettr.compile.lazy_templates import LazyTemplate, defer  # noqa: E402
from ettr.patcher import Patcher  # noqa: E402


def test_a_lazy_template_compiles_once_at_its_first_use_and_is_then_the_template():
    compiled: list[str] = []

    def compile_(source: str) -> jinja2.Template:
        compiled.append(source)
        return jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(source)

    template = LazyTemplate(compile_, "{{ greeting }}, {{ name }}")
    assert compiled == []  # made, not compiled
    assert template.render(greeting="hello", name="rank 0") == "hello, rank 0"
    assert template.render(greeting="hi", name="rank 1") == "hi, rank 1"
    assert compiled == ["{{ greeting }}, {{ name }}"]
    assert template.name is None  # anything else is the compiled template's
    assert template.compiled() is template.compiled()
    with pytest.raises(AttributeError):
        template.__no_such_protocol__  # noqa: B018
    with pytest.raises(jinja2.UndefinedError):
        template.render(greeting="hello")


def test_a_lazy_template_copies_and_pickles_as_its_compiled_template():
    # What the compiled template does (a Jinja template neither pickles nor copies), the lazy one does.
    template = LazyTemplate(jinja2.Environment().from_string, "{{ x }}")
    for operation in (pickle.dumps, copy.copy, copy.deepcopy):
        try:
            expected = operation(template.compiled())
        except Exception as exc:
            with pytest.raises(type(exc)):
                operation(template)
        else:
            assert type(operation(template)) is type(expected)


def test_inductor_hands_out_lazy_templates_once_deferred_and_the_patch_undoes():
    from torch._inductor.codegen.common import KernelTemplate

    original = KernelTemplate.__dict__["_template_from_string"]
    patcher = Patcher()
    assert defer(patcher) is True
    assert defer(patcher) is True  # ours already: not wrapped twice
    template = KernelTemplate._template_from_string("{{ x | indent_except_first(1) }}")
    assert isinstance(template, LazyTemplate)
    assert template.render(x="a\nb") == "a\n    b"  # inductor's environment and filters
    broken = KernelTemplate._template_from_string("{% if %}")  # a syntax error: raised at the first use
    with pytest.raises(Exception, match="(?i)syntax|expected"):
        broken.render()
    patcher.undo()
    assert KernelTemplate.__dict__["_template_from_string"] is original
    assert not isinstance(KernelTemplate._template_from_string("{{ x }}"), LazyTemplate)


def test_without_inductor_nothing_is_deferred(monkeypatch):
    from ettr import torch_compat

    def moved():
        raise ImportError("no jinja2")

    monkeypatch.setattr(torch_compat, "inductor_kernel_template_class", moved)
    assert defer(Patcher()) is False
