"""Never the wrong code (issue 27): every tool's results say which code and which
deploy.yaml made them (bench/provenance.py), and a run from another checkout says so loudly."""

import json
from argparse import Namespace

from blockserve.bench import cache_bound, harness
from blockserve.bench.provenance import announce, provenance
from blockserve.bench.workloads import LengthMode
from blockserve.tools.launch import REPO


def test_provenance_names_the_imported_checkout_its_commit_and_deploy_yaml():
    facts = provenance()
    assert facts["code_dir"] == str(REPO) and facts["commit"]
    assert facts["deploy_yaml"] == str(REPO / "deploy" / "deploy.yaml")


def test_a_run_from_another_checkout_warns_and_records_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "deploy.yaml").write_text("applications: []\n")
    (tmp_path / "bench").mkdir()
    monkeypatch.chdir(tmp_path)
    facts = announce("tool")
    assert facts["cwd_checkout"] == str(tmp_path.resolve())
    assert "WARNING" in capsys.readouterr().err
    monkeypatch.chdir(REPO)
    assert "cwd_checkout" not in announce("tool")
    assert "WARNING" not in capsys.readouterr().err


def test_the_benchmarks_results_record_the_command_the_code_and_the_deploy_yaml(tmp_path):
    facts = provenance()
    args = Namespace(out=str(tmp_path / "harness"), seeds=[0], slo_ttft=2.0, slo_itl=0.1,
                     workloads=[])
    harness.write(args, harness.deployment_lengths(LengthMode.UNKNOWN), {}, {}, {}, facts)
    cache_bound.write(Namespace(out=str(tmp_path / "cache_bound")), {}, {}, facts)
    for name, tool in (("harness", "harness"), ("cache_bound", "cache_bound")):
        saved = json.loads((tmp_path / f"{name}.json").read_text())
        assert saved["command"].startswith(f"python -m blockserve.bench.{tool}")
        assert {key: saved[key] for key in facts} == facts
