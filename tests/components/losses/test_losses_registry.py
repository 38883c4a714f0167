"""Registry: every name builds and runs, strict names and keys, configured position weighting."""

import pytest
import torch

import components.losses as L
from components.losses import registry


def full_inputs(b, **overrides):
    fields = {
        "draft_logits": b.draft,
        "target_logits": b.target,
        "target_tokens": b.tokens,
        "valid": b.valid,
        "confidence_logits": b.conf,
    }
    fields.update(overrides)
    return L.LossInputs(**fields)


EXPECTED = {"ce", "kl", "tv", "lk_hybrid", "lk_likelihood", "e2e_tv", "bv", "tv_ce_confidence", "confidence", "opd"}


def test_registry_holds_the_documented_names():
    assert set(L.LOSSES) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("weighting", [None, {"kind": "decay", "kappa": 4.0}, {"kind": "dpace"}])
def test_every_loss_builds_runs_and_logs(name, weighting, batch):
    loss = L.build_loss(name, weighting=weighting)
    out = loss(full_inputs(batch))
    assert out.loss.shape == () and torch.isfinite(out.loss)
    out.loss.backward()
    graded = batch.conf if name == "confidence" else batch.draft
    assert graded.grad is not None and torch.isfinite(graded.grad).all()
    metrics = out.metrics()
    gamma = batch.draft.shape[1]
    assert {f"alpha/{k}" for k in range(1, gamma + 1)} <= set(metrics)
    assert "tau" in metrics and "loss" in metrics
    assert out.per_position.shape == (gamma,)


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown loss 'nope'") as err:
        L.build_loss("nope")
    for name in EXPECTED:
        assert name in str(err.value)


def test_unknown_parameters_and_weighting_keys_raise():
    with pytest.raises(ValueError, match="eta"):
        L.build_loss("kl", eta=3.0)
    with pytest.raises(ValueError, match="weighting kind"):
        L.build_loss("kl", weighting={"kind": "cosine"})
    with pytest.raises(ValueError, match="weighting key"):
        L.build_loss("kl", weighting={"kind": "decay", "kapa": 3})
    assert L.loss_params(L.lk_hybrid_loss) == {"temperature": 1.0, "eta": 3.0, "per_block": False}


def test_params_reach_the_loss(batch):
    built = L.build_loss("lk_hybrid", eta=0.5, temperature=0.8)(full_inputs(batch)).loss
    direct = L.lk_hybrid_loss(
        batch.target, batch.draft, valid=batch.valid, eta=0.5, temperature=0.8
    ).loss
    torch.testing.assert_close(built, direct)


def test_decay_weighting_times_given_weights(batch):
    kw = {"valid": batch.valid}
    decay = L.decay_weights(4, 2.0, dtype=torch.float64)
    built = L.build_loss("kl", weighting={"kind": "decay", "kappa": 2.0})
    torch.testing.assert_close(
        built(full_inputs(batch)).loss,
        L.kl_loss(batch.target, batch.draft, weights=decay, **kw).loss,
    )
    given = full_inputs(batch, position_weights=batch.weights)
    torch.testing.assert_close(
        built(given).loss,
        L.kl_loss(batch.target, batch.draft, weights=decay * batch.weights, **kw).loss,
    )


@pytest.mark.parametrize("source", ["tv", "confidence"])
def test_dpace_weighting_uses_the_chosen_acceptance_source(source, batch):
    built = L.build_loss("tv", weighting=L.PositionWeighting(kind="dpace", source=source))
    if source == "tv":
        alpha = L.acceptance_rate(batch.target, batch.draft)
    else:
        alpha = torch.sigmoid(batch.conf)
    w = L.dpace_weights(alpha, batch.valid)
    expected = L.tv_loss(batch.target, batch.draft, valid=batch.valid, weights=w).loss
    torch.testing.assert_close(built(full_inputs(batch)).loss, expected)
    with pytest.raises(ValueError, match="D-PACE source"):
        L.PositionWeighting(kind="dpace", source="oracle")


def test_register_loss_adds_a_name_once(monkeypatch, batch):
    monkeypatch.setattr(registry, "LOSSES", dict(registry.LOSSES))

    def half_kl(target_logits, draft_logits, *, valid=None, temperature=1.0):
        out = L.kl_loss(target_logits, draft_logits, valid=valid, temperature=temperature)
        out.loss = 0.5 * out.loss
        return out

    registry.register_loss("half_kl", half_kl)
    with pytest.raises(ValueError, match="already registered"):
        registry.register_loss("half_kl", half_kl)
    got = registry.build_loss("half_kl")(full_inputs(batch)).loss
    torch.testing.assert_close(
        got, 0.5 * L.kl_loss(batch.target, batch.draft, valid=batch.valid).loss
    )
