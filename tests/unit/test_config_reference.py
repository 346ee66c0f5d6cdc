"""The generated configuration reference: the committed page is what the models generate, every
key has a description and every rule a docstring, `check-config --explain KEY` prints a key's
entry (an unknown key names close matches, exit 2), and `run --set KEY=VALUE` reaches the
run's config."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import reference
from tests.support.cli import run_cli
from tests.unit.test_config_keys import config_keys

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "configuration.md"
EXAMPLES = ROOT / "examples" / "configs"


_cli = run_cli


def test_committed_page_is_what_the_models_generate():
    assert PAGE.is_file(), f"{PAGE.relative_to(ROOT)} is missing; write it with `{reference.REGENERATE}`"
    assert PAGE.read_text() == reference.render(), (
        f"{PAGE.relative_to(ROOT)} differs from what the config models generate; regenerate it with "
        f"`{reference.REGENERATE}` and commit it"
    )


def test_every_key_has_a_description_and_every_rule_a_docstring():
    assert reference.missing() == [], "give each field a Field(description=...) and each rule a docstring"


def test_the_reference_lists_every_key_the_models_have():
    listed = {key.name.replace("[]", "") for key in reference.keys()}
    walked = {name for name, _ in config_keys(reference.Config)}
    assert walked <= listed  # the key check dedupes repeated sections; the page writes them all out
    assert "value.model.seq_len" in listed and "orchestrator.eval.name" in listed


def test_entries_show_type_default_range_and_description():
    entry = reference.find("orchestrator.top_p")
    assert (entry.type, entry.default, entry.range) == ("float", "1.0", "> 0, <= 1")
    assert reference.find("orchestrator.dynamic_sampling.on_limit").range == 'one of "train", "wait", "stop"'
    assert reference.find("orchestrator.dynamic_sampling.max_extra_groups").default == "required"
    assert reference.find("model.architecture.head_dim").type == "int | null"
    assert reference.find("orchestrator.eval[3].temperature").name == "orchestrator.eval[].temperature"
    assert reference.find("value.optimizer.lr").default.startswith("1e-05 (section left out)")
    assert "sao 0.3" in reference.find("algorithm.eps_low").default
    assert "plug-in" in reference.find("orchestrator.environment").range
    page = reference.render()
    assert "## Cross-field rules" in page
    for rule in reference.RULES:
        assert f"**{rule.__name__}**" in page
    assert "**_settings_fit**" in page and "**_std_agrees**" in page


def test_explain_prints_a_keys_entry():
    done = _cli("check-config", "--explain", "orchestrator.dynamic_sampling.max_extra_groups")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("orchestrator.dynamic_sampling.max_extra_groups\n")
    assert "type:        int" in done.stdout and "range:       >= 0" in done.stdout
    assert "default:     required" in done.stdout and "batch_size" in done.stdout
    done = _cli("check-config", "--explain", "orchestrator.top_p")
    assert done.returncode == 0 and "rule training_samples_are_untruncated" in done.stdout


def test_explain_an_unknown_key_suggests_close_ones():
    done = _cli("check-config", "--explain", "orchestrator.dynamic_sampling.max_extra_group")
    assert done.returncode == 2 and done.stdout == ""
    assert "unknown config key 'orchestrator.dynamic_sampling.max_extra_group'" in done.stderr
    assert "did you mean orchestrator.dynamic_sampling.max_extra_groups" in done.stderr


def test_config_reference_command_writes_the_page(tmp_path):
    out = tmp_path / "reference" / "configuration.md"
    done = _cli("config-reference", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_text() == reference.render()


@pytest.mark.parametrize("example", ["tiny_cpu_grpo.yaml"])
def test_run_set_reaches_the_runs_config(tmp_path, example):
    """`run --set` overrides like check-config's: the dry run plans with the overridden config
    (its run directory and the resolved file under it), and a bad override is an error."""
    run_dir = tmp_path / "swept"
    done = _cli("run", str(EXAMPLES / example), "--dry-run", "--set", f"logging.dir={run_dir}",
                "--set", "orchestrator.num_steps=7", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"resolved config -> {run_dir}/resolved.json" in done.stdout
    assert f"{run_dir}/logs/policy.log" in done.stdout
    assert not run_dir.exists()  # a dry run writes nothing
    done = _cli(
        "run", str(EXAMPLES / example), "--dry-run", "--set", "orchestrator.num_steps=0", cwd=tmp_path
    )
    assert done.returncode == 2 and "orchestrator.num_steps" in done.stderr


def test_run_local_applies_overrides(tmp_path):
    import io

    from megatron_rl.launch.local import run_local

    out = io.StringIO()
    code = run_local(str(EXAMPLES / "tiny_cpu_grpo.yaml"), dry_run=True, out=out,
                     overrides=[f"logging.dir={tmp_path}/o"])  # fmt: skip
    assert code == 0 and f"{tmp_path}/o/resolved.json" in out.getvalue()
