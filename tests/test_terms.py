"""The generic ``agentcredit.terms`` block: recipe validation (:func:`agentcredit.recipe.check_terms`) and the
hand-off to ``make_trainer(terms=...)`` (:func:`agentcredit.trl.credit.term_mixin`), on a test term plugin."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from credit_plugins import hookimpl, registry
from credit_plugins.estimator import param, params_dataclass
from distill_plugins.terms import TermSpec

pytest.importorskip("trl")

from agentcredit.recipe import RecipeError, check_terms  # noqa: E402


@params_dataclass(frozen=True)
class _Params:
    weight: float = param(0.5, "a weight", low=0.0, high=1.0)


@dataclass(frozen=True)
class _Spec(TermSpec):
    trl_mixin: str = ""


class TestTermMixin:
    """What a term's TRL mixin reads: its parameters from the class attribute ``terms``."""

    terms: dict = {}


class _Plugin:
    @hookimpl
    def agentcredit_terms(self):
        return [_Spec("test_term", _Params, "test", "a test term", trl_mixin=f"{__name__}:TestTermMixin"),
                TermSpec("test_verl_only", _Params, "test", "a verl-only term", bridges=("verl",))]


@pytest.fixture
def term():
    name = registry.register_plugin(_Plugin(), name="test-terms")
    yield "test_term"
    registry.unregister_plugin(name)


def test_check_terms_fills_null_params_and_keeps_given_ones(term):
    assert check_terms(None) == {}
    assert check_terms({term: None}) == {term: {}}
    assert check_terms({term: {"weight": 0.25}}) == {term: {"weight": 0.25}}


@pytest.mark.parametrize("block, words", [
    ([1], ["agentcredit.terms must be a mapping"]),
    ({"test_trem": {}}, ["'test_trem' is not a registered term", "did you mean 'test_term'"]),
    ({"test_term": 3}, ["agentcredit.terms.test_term must be a mapping"]),
    ({"test_term": {"weight": 2.0}}, ["agentcredit.terms.test_term", "weight=2.0", "[0.0, 1.0]"]),
    ({"test_term": {"wieght": 0.1}}, ["agentcredit.terms.test_term", "wieght"]),
    ({"test_verl_only": {}}, ["runs on verl, not on trl"]),
])
def test_check_terms_names_the_key_and_the_fix(term, block, words):
    with pytest.raises(RecipeError) as e:
        check_terms(block)
    for w in words:
        assert w in str(e.value)


def test_make_trainer_puts_the_term_mixin_first_with_its_params(term):
    import trl

    from agentcredit.trl import make_trainer

    cls = make_trainer(trl.GRPOTrainer, credit="grpo", terms={term: {"weight": 0.75}})
    assert cls.__mro__[1] is TestTermMixin and cls.terms == {term: {"weight": 0.75}}
    with pytest.raises(ValueError, match="weight"):
        make_trainer(trl.GRPOTrainer, terms={term: {"weight": -1.0}})
    with pytest.raises(ValueError, match="unknown term"):
        make_trainer(trl.GRPOTrainer, terms={"no_such_term": {}})
    with pytest.raises(ValueError, match="not on TRL"):
        make_trainer(trl.GRPOTrainer, terms={"test_verl_only": {}})


def test_recipe_terms_block_is_validated_at_load(term):
    from pathlib import Path

    from agentcredit.recipe import load_recipe

    path = str(Path(__file__).resolve().parents[1] / "recipes" / "trl" / "minigrid_gigpo.yaml")
    assert load_recipe(path, validate_trl=False).agentcredit.terms == {}
    r = load_recipe(path, ["agentcredit.terms={test_term: {weight: 0.3}}"], validate_trl=False)
    assert r.agentcredit.terms == {"test_term": {"weight": 0.3}}
    with pytest.raises(RecipeError, match="agentcredit.terms.test_term"):
        load_recipe(path, ["agentcredit.terms.test_term.weight=7"], validate_trl=False)


def test_every_registered_term_gets_a_docs_page_with_its_describe_text_and_notes():
    import dataclasses
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("tables", Path(__file__).resolve().parents[1] / "docs" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    assert "terms" in tables.KINDS
    for name, item, _ in tables.items("terms"):
        page = tables.method_page("terms", name)
        assert page.startswith(f"# `{name}`") and item.describe() in page and "- **bridges:**" in page
        for field in dataclasses.fields(item.params):
            assert f"| `{field.name}` |" in page, (name, field.name)
        note = tables.notes("terms", name)
        assert note is None or note in page
    assert "[`sprpo`](sprpo.md)" in tables.index_page("terms")
