"""The algorithm toolbox (algorithms/registry.py): each outcome estimator and each new policy loss
against a plain reference written here as a loop, gradients included; presets and parts in the
config; plug-ins, and the errors a wrong import path or signature gives."""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_rl.algorithms import Sequences, make_algorithm, registry
from megatron_rl.algorithms import advantages as adv
from megatron_rl.algorithms.losses import cispo_loss, gspo_loss
from megatron_rl.algorithms.registry import advantage_estimator, policy_loss, policy_loss_for
from megatron_rl.config import AlgorithmConfig, ConfigError, parse_config
from megatron_rl.config.plugins import PluginError, load_plugin
from megatron_rl.data import TrainingSample
from megatron_rl.envs import Environment, make_environment
from tests.support.configs import base

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "plugins"


@pytest.fixture()
def example_parts(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    sys.modules.pop("my_rl_parts", None)


def random_groups(seed: int) -> list[torch.Tensor]:
    """Groups of 1 to 6 members, some with equal rewards."""
    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(7):
        size = int(rng.integers(1, 7))
        rewards = rng.normal(size=size) if rng.random() < 0.7 else np.full(size, float(rng.integers(0, 2)))
        groups.append(torch.tensor(rewards, dtype=torch.float64))
    return groups


def random_action_tokens(groups: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Each member's action-token count, 1 to 12."""
    rng = np.random.default_rng(seed + 100)
    return [torch.tensor(rng.integers(1, 13, size=g.numel()), dtype=torch.int64) for g in groups]


def verl_token_whiten(rows: list[list[float]], counts: list[list[int]]) -> list[list[float]]:
    """verl 0.9.1's REINFORCE++ whitening written plainly: each member's score laid on its K
    response tokens, then verl_F.masked_whiten over the batch (masked_mean divides by the mask's
    sum + 1e-8; masked_var is unbiased, mask_sum / (mask_sum - 1)), read back on the tokens."""
    tokens = [x for row, ks in zip(rows, counts) for x, k in zip(row, ks) for _ in range(k)]
    n = len(tokens)
    mean = sum(tokens) / (n + 1e-8)
    var = sum((x - mean) ** 2 for x in tokens) / (n + 1e-8) * (n / (n - 1))
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def loop_reference(name: str, groups: list[torch.Tensor], action_tokens: list[torch.Tensor]) -> list[list[float]]:
    """The estimators as loops over members (verl's definitions; a group of one gets no baseline)."""
    out = []
    for g in groups:
        r = g.tolist()
        n = len(r)
        mean = sum(r) / n
        if name == "grpo":
            std = math.sqrt(sum((x - mean) ** 2 for x in r) / (n - 1)) if n > 1 else 0.0
            out.append([(x - mean) / (std + 1e-6) if n > 1 else 0.0 for x in r])
        elif name == "dr_grpo":
            out.append([x - mean if n > 1 else 0.0 for x in r])
        elif name == "rloo":
            out.append([x - (sum(r) - x) / (n - 1) if n > 1 else 0.0 for x in r])
        elif name in ("reinforce_pp", "reinforce_pp_baseline"):
            out.append([x - mean if n > 1 else 0.0 for x in r] if name.endswith("baseline") else r)
    if name.startswith("reinforce_pp"):
        out = verl_token_whiten(out, [k.tolist() for k in action_tokens])
    return out


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_estimator_equals_its_loop_reference(name, seed):
    groups = random_groups(seed)
    action_tokens = random_action_tokens(groups, seed)
    got = advantage_estimator(name)(groups, action_tokens)
    assert [tuple(g.shape) for g in got] == [tuple(g.shape) for g in groups]
    # verl's 1e-8 in masked_mean's denominator moves the whitened values by ~1e-9; none elsewhere.
    tolerance = 1e-8 if name.startswith("reinforce_pp") else 1e-12
    for row, expected in zip(got, loop_reference(name, groups, action_tokens)):
        np.testing.assert_allclose(row.numpy(), expected, rtol=tolerance, atol=tolerance)


def test_batch_estimators_whiten_over_every_action_token_of_the_step_not_per_group():
    groups = [torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([5.0, 5.0, 4.0], dtype=torch.float64)]
    action_tokens = [torch.tensor([3, 1]), torch.tensor([2, 7, 4])]
    whole = advantage_estimator("reinforce_pp")(groups, action_tokens)
    on_tokens = torch.cat([a.repeat_interleave(k) for a, k in zip(whole, action_tokens)])
    assert on_tokens.mean().abs() < 1e-12 and on_tokens.std() == pytest.approx(1.0, abs=1e-6)
    alone = advantage_estimator("reinforce_pp")(groups[:1], action_tokens[:1])[0]
    assert not torch.allclose(alone, whole[0])  # its value depends on the other group
    with pytest.raises(ValueError, match=r"'reinforce_pp' weighs each member by its action tokens"):
        advantage_estimator("reinforce_pp")(groups)


@pytest.mark.parametrize("tokens_each, members", [(1, 5), (4, 6), (16, 3)])
def test_token_whitening_differs_from_whitening_members_by_the_documented_factor(tokens_each, members):
    """With every member holding K action tokens, whitening over the N K tokens (verl) and over
    the N members differ by sqrt(K (N - 1) / (N K - 1)): the unbiased variances' ratio."""
    rewards = torch.tensor(np.random.default_rng(members).normal(size=members))
    tokens = adv.token_whitened([rewards], [torch.full((members,), tokens_each)])[0]
    centred = rewards - rewards.mean()
    per_member = centred / torch.sqrt(centred.var(unbiased=True) + 1e-8)
    factor = math.sqrt(tokens_each * (members - 1) / (members * tokens_each - 1))
    torch.testing.assert_close(per_member, tokens * factor, rtol=1e-6, atol=1e-9)
    assert (tokens_each == 1) == (factor == 1.0)


def test_token_whitening_refuses_counts_that_do_not_fit_the_values_naming_them():
    values = [torch.tensor([1.0, 2.0]), torch.tensor([0.5])]
    with pytest.raises(ValueError, match=r"action_tokens: 1 groups for 2 groups of values"):
        adv.token_whitened(values, [torch.tensor([3, 1])])
    with pytest.raises(ValueError, match=r"action_tokens of group 1: shape \(2,\), values \(1,\)"):
        adv.token_whitened(values, [torch.tensor([3, 1]), torch.tensor([2, 2])])
    with pytest.raises(ValueError, match=r"action_tokens: negative counts \[-1.0\]"):
        adv.token_whitened(values, [torch.tensor([3, -1]), torch.tensor([2])])
    assert adv.token_whitened([], []) == []


def test_gae_is_not_an_outcome_estimator_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match="needs the critic's values"):
        advantage_estimator("gae")
    with pytest.raises(ValueError, match=r"algorithm.advantage: unknown 'grop'"):
        advantage_estimator("grop")
    with pytest.raises(ValueError, match=r"algorithm.policy_loss: unknown 'ppo'"):
        policy_loss("ppo")


def test_masked_whiten_of_gae_advantages_is_over_every_action_token_of_the_step():
    rng = np.random.default_rng(0)
    rows = [torch.tensor(rng.normal(size=n)) for n in (5, 9, 3)]
    masks = [torch.tensor(rng.random(len(r)) < 0.6) for r in rows]
    masks[0][0] = masks[0][1] = True
    got = adv.masked_whiten(rows, masks)
    flat = [x for r, m in zip(rows, masks) for x, keep in zip(r.tolist(), m.tolist()) if keep]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    for r, m, g in zip(rows, masks, got):
        expected = [(x - mean) / math.sqrt(var + 1e-8) if keep else 0.0 for x, keep in zip(r.tolist(), m.tolist())]
        np.testing.assert_allclose(g.numpy(), expected, rtol=1e-12, atol=1e-12)


def critic_group(group_id, rewards, seed):
    rng = np.random.default_rng(seed)
    samples = []
    for branch, reward in enumerate(rewards):
        n = 8 + branch
        mask = np.arange(n) >= 3
        samples.append(TrainingSample(token_ids=rng.integers(0, 50, n), loss_mask=mask, inference_logprobs=np.zeros(n),
                                      reward=reward, group_id=group_id, branch_index=branch, episode_done=True))  # fmt: skip
    return samples


def test_critic_algorithm_whitens_the_steps_advantages_when_asked():
    from megatron_rl.data import ScoreResult
    from tests.support.orchestrator import InProcessScorer

    def scorer(batched):
        return ScoreResult(values=[np.linspace(0, 1, len(ids), dtype=np.float32) for ids in batched],
                           bootstrap_values=[0.0] * len(batched))  # fmt: skip

    plain = make_algorithm(AlgorithmConfig(type="ppo"), InProcessScorer(scorer))
    whitened = make_algorithm(AlgorithmConfig(type="ppo", whiten_advantages=True), InProcessScorer(scorer))
    groups_a = [critic_group(0, [1.0, 0.0], 0), critic_group(1, [0.5, 0.2, 0.9], 1)]
    groups_b = [critic_group(0, [1.0, 0.0], 0), critic_group(1, [0.5, 0.2, 0.9], 1)]
    asyncio.run(plain.prepare_batch(groups_a))
    asyncio.run(whitened.prepare_batch(groups_b))
    rows = [torch.tensor(s.advantages, dtype=torch.float64) for g in groups_a for s in g]
    masks = [torch.tensor(s.loss_mask) for g in groups_a for s in g]
    expected = adv.masked_whiten(rows, masks)
    got = [s.advantages for g in groups_b for s in g]
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e.numpy(), atol=1e-6)
    flat = np.concatenate([g[m.numpy()] for g, m in zip(got, masks)])
    assert abs(flat.mean()) < 1e-5 and flat.std(ddof=1) == pytest.approx(1.0, abs=1e-4)


def outcome_group(group_id, rewards):
    return [TrainingSample(token_ids=np.arange(6), loss_mask=np.arange(6) >= 2, inference_logprobs=np.zeros(6),
                           reward=r, group_id=group_id, branch_index=i) for i, r in enumerate(rewards)]  # fmt: skip


def test_outcome_algorithm_puts_each_members_advantage_on_its_action_tokens():
    groups = [outcome_group(0, [1.0, 0.0, 0.5]), outcome_group(1, [0.2, 0.4])]
    asyncio.run(make_algorithm(AlgorithmConfig(type="grpo", advantage="rloo")).prepare_batch(groups))
    expected = loop_reference("rloo", [torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.2, 0.4])], [])
    for group, values in zip(groups, expected):
        for sample, value in zip(group, values):
            np.testing.assert_allclose(sample.advantages[sample.loss_mask], value, atol=1e-6)
            assert (sample.advantages[~sample.loss_mask] == 0).all()


def test_reinforce_pp_in_the_orchestrator_weighs_members_by_their_action_tokens():
    """OutcomeAlgorithm gives the estimator each sample's action-token count (its loss mask):
    the advantages on the tokens equal verl's whitening over the tokens of the whole step."""
    groups, counts = [], []
    for group_id, (rewards, lengths) in enumerate([([1.0, 0.0, 0.5], [3, 9, 1]), ([0.2, 0.9], [6, 2])]):
        group = []
        for branch, (reward, k) in enumerate(zip(rewards, lengths)):
            mask = np.arange(4 + k) >= 4
            group.append(TrainingSample(token_ids=np.arange(4 + k), loss_mask=mask, inference_logprobs=np.zeros(4 + k),
                                        reward=reward, group_id=group_id, branch_index=branch))  # fmt: skip
        groups.append(group)
        counts.append(lengths)
    for name in ("reinforce_pp", "reinforce_pp_baseline"):
        asyncio.run(make_algorithm(AlgorithmConfig(type="grpo", advantage=name)).prepare_batch(groups))
        rewards = [torch.tensor([s.reward for s in g], dtype=torch.float64) for g in groups]
        expected = loop_reference(name, rewards, [torch.tensor(c) for c in counts])
        for group, values in zip(groups, expected):
            for sample, value in zip(group, values):
                np.testing.assert_allclose(sample.advantages[sample.loss_mask], value, rtol=1e-6)
                assert (sample.advantages[~sample.loss_mask] == 0).all()


def test_a_plugin_estimator_gets_action_tokens_only_when_it_declares_them(tmp_path, monkeypatch):
    (tmp_path / "counting_parts.py").write_text(
        "def per_token(groups, *, action_tokens, scale=1.0):\n"
        "    return [g * scale + k for g, k in zip(groups, action_tokens)]\n"
        "def per_member(groups, scale=1.0):\n"
        "    return [g * scale for g in groups]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    groups = [outcome_group(0, [1.0, 0.0]), outcome_group(1, [0.5, 0.2, 0.4])]
    groups[1][2].loss_mask[-1] = False  # 3 action tokens; every other member has 4
    for name, expected in (("per_token", [6.0, 4.0, 5.0, 4.4, 3.8]), ("per_member", [2.0, 0.0, 1.0, 0.4, 0.8])):
        config = AlgorithmConfig(type="grpo", advantage=f"counting_parts:{name}", advantage_args={"scale": 2.0})
        asyncio.run(make_algorithm(config).prepare_batch(groups))
        got = [float(s.advantages[s.loss_mask][0]) for g in groups for s in g]
        np.testing.assert_allclose(got, expected, rtol=1e-6)
    parts = load_plugin("advantage", "counting_parts:per_token", "algorithm.advantage", ("scale",))
    assert registry.takes_action_tokens(parts) and not registry.takes_action_tokens(lambda groups: groups)
    sys.modules.pop("counting_parts", None)


# -- losses --------------------------------------------------------------------------------------


def packed_tokens(seed: int, lengths=(5, 8, 3, 6)):
    """Four packed sequences: the first two with a sequence ratio of about e^0.01 and e^-0.01 (and an
    advantage of that sign: GSPO clips them), the others with ratios within 1e-3 of 1."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    logprobs = (-torch.rand(n, generator=g, dtype=torch.float64) * 3).requires_grad_()
    shift = torch.tensor([-0.01, 0.01, 0.0, 0.0], dtype=torch.float64)[sequence]
    old = logprobs.detach() + shift + torch.empty(n, dtype=torch.float64).uniform_(-1e-3, 1e-3, generator=g)
    mask = torch.rand(n, generator=g) < 0.75
    mask[torch.tensor(lengths).cumsum(0) - 1] = True  # every sequence has an action token
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    per_sequence_advantage = signs * (0.5 + torch.rand(len(lengths), generator=g, dtype=torch.float64))
    advantages = per_sequence_advantage[sequence] * mask
    weights = torch.rand(n, generator=g, dtype=torch.float64)
    return logprobs, old, advantages, mask, weights, Sequences.single(list(lengths)), list(lengths)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_gspo_equals_a_per_sequence_loop_with_its_gradient(seed):
    logprobs, old, advantages, mask, weights, sequences, lengths = packed_tokens(seed)
    eps_low, eps_high = 3e-3, 4e-3
    loss, metrics = gspo_loss(logprobs, old, advantages, mask, eps_low, eps_high, weights=weights, sequences=sequences)
    loss.backward()
    expected_loss, expected_grad, clipped, start = 0.0, torch.zeros_like(old), 0, 0
    lp = logprobs.detach()
    for length in lengths:
        tokens = [t for t in range(start, start + length) if mask[t]]
        if tokens:
            s = math.exp(sum(float(lp[t] - old[t]) for t in tokens) / len(tokens))  # the sequence ratio
            for t in tokens:
                a, w = float(advantages[t]), float(weights[t])
                unclipped, bounded = -s * a, -min(max(s, 1 - eps_low), 1 + eps_high) * a
                expected_loss += w * max(unclipped, bounded)
                if bounded > unclipped:
                    clipped += 1  # the clipped branch: constant, no gradient
                else:
                    expected_grad[t] = -w * a * s  # d(sg[s] * pi / sg[pi]) / d log pi = s
        start += length
    assert float(loss) == pytest.approx(expected_loss, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(logprobs.grad, expected_grad, rtol=1e-10, atol=1e-12)
    assert float(metrics["clipped_sum"]) == clipped
    assert 0 < clipped < int(mask.sum())  # both branches were exercised


def test_gspo_packed_equals_each_sequence_alone():
    logprobs, old, advantages, mask, _, sequences, lengths = packed_tokens(4)
    packed, _ = gspo_loss(logprobs, old, advantages, mask, sequences=sequences)
    alone, start = 0.0, 0
    for length in lengths:
        part = slice(start, start + length)
        loss, _ = gspo_loss(logprobs[part], old[part], advantages[part], mask[part], sequences=Sequences.single([length]))
        alone += float(loss)
        start += length
    assert float(packed) == pytest.approx(alone, rel=1e-12)


def test_gspo_without_sequences_is_refused():
    logprobs, old, advantages, mask, *_ = packed_tokens(0)
    with pytest.raises(ValueError, match="needs `sequences`"):
        gspo_loss(logprobs, old, advantages, mask)


@pytest.mark.parametrize("seed", [0, 1])
def test_cispo_equals_a_token_loop_and_its_weight_is_detached(seed):
    logprobs, old, advantages, mask, weights, sequences, _ = packed_tokens(seed)
    old = logprobs.detach() + torch.linspace(-0.5, 0.5, len(old), dtype=torch.float64)  # some ratios outside the band
    loss, metrics = cispo_loss(logprobs, old, advantages, mask, 0.2, 0.28, weights=weights, sequences=sequences)
    loss.backward()
    expected_loss, expected_grad, clipped = 0.0, torch.zeros_like(old), 0
    for t in range(len(old)):
        if not mask[t]:
            continue
        r = math.exp(float(logprobs[t] - old[t]))
        w = min(max(r, 0.8), 1.28)
        clipped += w != r
        expected_loss += -float(weights[t]) * w * float(advantages[t]) * float(logprobs[t])
        expected_grad[t] = -float(weights[t]) * w * float(advantages[t])  # the weight is a constant
    assert float(loss) == pytest.approx(expected_loss, rel=1e-10)
    torch.testing.assert_close(logprobs.grad, expected_grad, rtol=1e-10, atol=1e-12)
    assert float(metrics["clipped_sum"]) == clipped > 0
    assert (logprobs.grad[mask] != 0).sum() == (advantages[mask] != 0).sum()  # no token loses its gradient


def test_policy_loss_for_binds_the_configs_coefficients():
    logprobs, old, advantages, mask, _, sequences, _ = packed_tokens(1)
    config = AlgorithmConfig(type="grpo", policy_loss="gspo")
    assert (config.eps_low, config.eps_high, config.loss_aggregation) == (3e-4, 4e-4, "seq-mean-token-mean")
    got, _ = policy_loss_for(config)(logprobs, old, advantages, mask, sequences=sequences, weights=None)
    expected, _ = gspo_loss(logprobs, old, advantages, mask, 3e-4, 4e-4, sequences=sequences)
    assert float(got) == float(expected)
    mine = AlgorithmConfig(type="grpo", policy_loss="gspo", eps_low=0.1, loss_aggregation="token-mean")
    assert (mine.eps_low, mine.eps_high, mine.loss_aggregation) == (0.1, 4e-4, "token-mean")  # the user's win


# -- config: presets and parts ---------------------------------------------------------------------


def test_presets_fill_the_parts_and_explicit_parts_win():
    parts = lambda **kw: (lambda c: (c.advantage, c.policy_loss))(AlgorithmConfig(**kw))  # noqa: E731
    assert parts(type="grpo") == ("grpo", "ppo_clip")
    assert parts(type="grpo", normalize_advantage_std=False) == ("dr_grpo", "ppo_clip")
    assert parts(type="ppo") == ("gae", "ppo_clip")
    assert parts(type="sao") == ("gae", "dis")
    assert parts(type="sao", policy_loss="cispo") == ("gae", "cispo")
    assert parts(type="grpo", advantage="reinforce_pp") == ("reinforce_pp", "ppo_clip")
    assert AlgorithmConfig(type="sao", advantage="rloo").eps_high == 5.0  # the preset's coefficients stay
    resolved = AlgorithmConfig(type="grpo", normalize_advantage_std=False)
    assert AlgorithmConfig(**resolved.model_dump()) == resolved  # the resolved file reads back the same


def config_errors(data) -> str:
    with pytest.raises(ConfigError) as raised:
        parse_config(data)
    return str(raised.value)


def test_bad_parts_are_errors_that_name_the_key_and_the_registrys_choices():
    """Resolving a config checks its part names against the registry (config/parts.py)."""
    data = base("grpo")
    data["algorithm"]["advantage"] = "rlo"
    data["algorithm"]["policy_loss"] = "gpso"
    errors = config_errors(data)
    advantages = ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
    assert f"algorithm.advantage: unknown 'rlo'; choose from {advantages} or give a plug-in as 'package.module:name'" in errors
    assert "algorithm.policy_loss: unknown 'gpso'; choose from ['ppo_clip', 'dis', 'gspo', 'cispo']" in errors
    assert "value:" not in errors  # an unknown estimator is not also said to lack or need a critic
    with pytest.raises(ValueError, match=r"normalize_advantage_std: false contradicts algorithm.advantage 'grpo'"):
        AlgorithmConfig(type="grpo", advantage="grpo", normalize_advantage_std=False)


def test_every_part_name_the_config_writes_is_registered_once_with_what_it_reads():
    """The presets' parts, the policy losses with defaults of their own and the dr_grpo that
    normalize_advantage_std: false picks are registered; each built-in's name is declared on its
    function, once; each key a loss reads is an algorithm key."""
    from megatron_rl.algorithms import parts
    from megatron_rl.config.algorithm import POLICY_LOSS_DEFAULTS, PRESET_PARTS

    for preset, (advantage, loss) in PRESET_PARTS.items():
        assert advantage in parts.ADVANTAGE_ESTIMATORS and loss in parts.POLICY_LOSSES, preset
        config = AlgorithmConfig(type=preset, normalize_advantage_std=False) if advantage == "grpo" else None
        assert config is None or config.advantage in parts.ADVANTAGE_ESTIMATORS
    assert set(POLICY_LOSS_DEFAULTS) <= set(parts.POLICY_LOSSES)
    for table in (parts.ADVANTAGE_ESTIMATORS, parts.POLICY_LOSSES):
        for name, part in table.items():
            assert part.name == name and getattr(part.function, "__module__", "").startswith("megatron_rl.algorithms")
    coefficients = registry.loss_coefficients(AlgorithmConfig(type="ppo"))
    for part in parts.POLICY_LOSSES.values():
        assert set(part.reads) <= set(coefficients) <= set(AlgorithmConfig.model_fields), part.name
    assert registry.builtin_parts().group_advantages == ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
    assert registry.builtin_parts().critic_advantages == ("gae",)


def test_a_name_declared_twice_is_an_error_naming_both_functions(tmp_path, monkeypatch):
    from megatron_rl.algorithms import parts

    before = (dict(parts.ADVANTAGE_ESTIMATORS), dict(parts.POLICY_LOSSES))
    (tmp_path / "twice.py").write_text(
        "from megatron_rl.algorithms.parts import register_advantage\n"
        "@register_advantage('rloo')\n"
        "def my_rloo(groups):\n"
        "    return groups\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"advantage 'rloo' is declared twice: by megatron_rl.algorithms.advantages"
                                         r".leave_one_out and by twice.my_rloo"):  # fmt: skip
        __import__("twice")
    sys.modules.pop("twice", None)
    with pytest.raises(ValueError, match=r"policy loss 'dis' is declared twice"):
        parts.register_policy_loss("dis", reads=())(lambda logprobs, old_logprobs, advantages, mask: None)
    with pytest.raises(ValueError, match=r"policy loss 'mine' reads \['eps_mid'\]"):
        parts.register_policy_loss("mine", reads=("eps_mid",))(lambda logprobs, eps_low=0.1: None)
    with pytest.raises(ValueError, match=r"no ':'"):
        parts.register_advantage("pkg:mine")(lambda groups: groups)
    assert (parts.ADVANTAGE_ESTIMATORS, parts.POLICY_LOSSES) == before  # nothing was declared


def test_the_loader_and_the_reference_read_the_registry_by_its_import_path():
    from megatron_rl.config import reference
    from megatron_rl.config.parts import builtin_parts

    assert builtin_parts() == registry.builtin_parts()
    for key, names in (("algorithm.advantage", registry.builtin_parts().advantages),
                       ("algorithm.policy_loss", registry.builtin_parts().policy_losses)):  # fmt: skip
        listed = reference.find(key).range
        assert all(f'"{name}"' in listed for name in names) and "plug-in" in listed, listed


def test_combinations_are_config_errors_naming_both_keys():
    data = base("grpo")
    data["algorithm"]["advantage"] = "gae"
    assert "value: algorithm.advantage 'gae' (algorithm.type 'grpo') needs a value section" in config_errors(data)
    data = base("grpo")
    data["algorithm"]["advantage"] = "rloo"
    data["orchestrator"]["group_size"] = 1
    assert "orchestrator.group_size: algorithm.advantage 'rloo'" in config_errors(data)
    data = base("sao")
    data["algorithm"]["advantage"] = "reinforce_pp"
    assert "value: algorithm.advantage 'reinforce_pp' (algorithm.type 'sao') reads no critic" in config_errors(data)
    data = base("grpo")
    data["algorithm"]["policy_loss_args"] = {"clip": 2}
    assert "algorithm.policy_loss_args: only a plug-in takes arguments" in config_errors(data)


# -- plug-ins ------------------------------------------------------------------------------------


def test_plugins_load_and_run(example_parts):
    loss = policy_loss("my_rl_parts:tempered_pg_loss", clip=1.5)
    logprobs, old, advantages, mask, weights, sequences, _ = packed_tokens(2)
    value, metrics = loss(logprobs, old, advantages, mask, sequences=sequences, weights=weights)
    value.backward()
    assert torch.isfinite(value) and float(metrics["num_tokens"]) == int(mask.sum())
    assert logprobs.grad[~mask].abs().sum() == 0 and logprobs.grad[mask].abs().sum() > 0
    estimator = advantage_estimator("my_rl_parts:median_baseline", shift=0.5)
    got = estimator([torch.tensor([1.0, 3.0, 2.0])])
    torch.testing.assert_close(got[0], torch.tensor([-0.5, 1.5, 0.5], dtype=torch.float32))
    environment = make_environment("my_rl_parts:ShortReverse", dataset=None, seed=3)
    assert isinstance(environment, Environment) and 2 <= len(environment.row(0)["word"]) <= 3


def test_a_wrong_import_path_or_signature_names_the_key_and_the_path(example_parts, tmp_path, monkeypatch):
    with pytest.raises(PluginError, match=r"algorithm.policy_loss: cannot import module 'no_such_module' of 'no_such_module:f'"):
        policy_loss("no_such_module:f")
    with pytest.raises(PluginError, match=r"algorithm.policy_loss: module 'my_rl_parts' has no 'missing'"):
        policy_loss("my_rl_parts:missing")
    with pytest.raises(PluginError, match=r"algorithm.advantage: 'my_rl_parts:torch' is a module, not a callable"):
        advantage_estimator("my_rl_parts:torch")
    (tmp_path / "bad_parts.py").write_text(
        "def loss(logprobs, old_logprobs, advantages):\n    return 0, {}\n"
        "def estimator(groups, *, alpha):\n    return groups\n"
        "def not_an_env(dataset=None, seed=0):\n    return 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"algorithm.policy_loss: 'bad_parts:loss' cannot be called as a policy_loss plug-in is"):
        policy_loss("bad_parts:loss")
    with pytest.raises(PluginError, match=r"'bad_parts:estimator' cannot be called.*alpha"):
        advantage_estimator("bad_parts:estimator")  # a required keyword the config does not give
    advantage_estimator("bad_parts:estimator", alpha=1.0)
    with pytest.raises(PluginError, match=r"orchestrator.environment: 'bad_parts:not_an_env' returned a int, not"):
        make_environment("bad_parts:not_an_env")
    with pytest.raises(PluginError, match=r"cannot be called as a policy_loss plug-in"):
        load_plugin("policy_loss", "my_rl_parts:tempered_pg_loss", "algorithm.policy_loss", ("beta",))


def test_an_estimator_that_returns_the_wrong_shape_is_named():
    groups = [outcome_group(0, [1.0, 0.0]), outcome_group(1, [0.2, 0.4, 0.1])]
    algorithm = make_algorithm(AlgorithmConfig(type="grpo"))
    algorithm.estimator = lambda rewards, action_tokens: rewards[:1]
    with pytest.raises(ValueError, match=r"algorithm.advantage 'grpo' returned 1 advantage tensors for 2 groups"):
        asyncio.run(algorithm.prepare_batch(groups))
    algorithm.estimator = lambda rewards, action_tokens: [r[:1] for r in rewards]
    with pytest.raises(ValueError, match=r"returned shape \(1,\) for group 0 of 2 members"):
        asyncio.run(algorithm.prepare_batch(groups))
    algorithm.estimator = lambda rewards, action_tokens: [r * float("nan") for r in rewards]
    with pytest.raises(ValueError, match="non-finite advantages for group 0"):
        asyncio.run(algorithm.prepare_batch(groups))


def test_check_config_imports_plugins_and_names_a_bad_one(example_parts):
    data = base("grpo")
    data["algorithm"].update(policy_loss="my_rl_parts:tempered_pg_loss", policy_loss_args={"clip": 3.0},
                             advantage="my_rl_parts:median_baseline")  # fmt: skip
    data["orchestrator"]["environment"] = "my_rl_parts:ShortReverse"
    resolved = parse_config(data)
    assert resolved.algorithm.policy_loss == "my_rl_parts:tempered_pg_loss"
    data["algorithm"]["policy_loss_args"] = {"beta": 3.0}
    assert "algorithm.policy_loss: 'my_rl_parts:tempered_pg_loss' cannot be called" in config_errors(data)
    data["algorithm"]["policy_loss_args"] = {}
    data["orchestrator"]["environment"] = "my_rl_parts:Nothing"
    assert "orchestrator.environment: module 'my_rl_parts' has no 'Nothing'" in config_errors(data)


def test_the_plugins_page_shows_the_example_loss_and_the_tested_assignments(example_parts):
    import inspect

    import my_rl_parts

    from tests.e2e.test_toolbox_examples import PLUGIN_SETS

    page = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    assert inspect.getsource(my_rl_parts.tempered_pg_loss) in page
    for assignment in PLUGIN_SETS:
        key, _, value = assignment.partition("=")
        assert f"--set {assignment}" in page or f'--set "{assignment}"' in page, assignment
