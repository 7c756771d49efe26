"""benchmarks/flashqla_probe.py runs every case on the CPU with the flash_qla stand-in (tests/ops/fake_flashqla.py)
at tiny sizes: each row is written, a case that fails (FlashQLA's own kernels are not in the stand-in) is
a row with its error and the next case runs. The numbers themselves come from the GPU."""

from __future__ import annotations

import json

from tests.ops import fake_flashqla


def test_probe_cases_write_rows(tmp_path, monkeypatch):
    from benchmarks import flashqla_probe as probe

    monkeypatch.setattr(probe, "DEVICE", "cpu")
    monkeypatch.setattr(probe, "REALISTIC", dict(hk=2, hv=4, dk=128, dv=128))
    fake_flashqla.install()
    try:
        out = tmp_path / "probe.jsonl"
        rc = probe.main(["--out", str(out), "--realistic-t", "96", "--iters", "2", "--cases", "accuracy,summary"])
    finally:
        fake_flashqla.uninstall()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_case: dict = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r)
    assert rc == 0, [r for r in rows if "error" in r]
    acc = by_case["accuracy"][0]["flashqla_vs_reference"]
    assert set(acc) == {"o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"} and max(acc.values()) < 1e-2, acc
    summary = {r["how"]: r for r in by_case["summary"] if "how" in r}
    assert summary["flashqla_scans"]["M_rel_l2"] < 1e-2 and summary["flashqla_scans"]["S_ext_rel_l2"] < 1e-2, summary
    assert "error" in summary["flashqla_fused_gdr_h"]  # FlashQLA's own kernels: GPU only
    assert by_case["all"][0]["summary"] is True


def test_a_failing_case_is_a_row_and_the_next_case_runs(tmp_path, monkeypatch):
    from benchmarks import flashqla_probe as probe

    def boom(args):
        raise RuntimeError("boom")

    monkeypatch.setattr(probe, "DEVICE", "cpu")
    monkeypatch.setattr(probe, "REALISTIC", dict(hk=2, hv=4, dk=128, dv=128))
    monkeypatch.setitem(probe.CASE_FUNCS, "accuracy", boom)
    fake_flashqla.install()
    try:
        out = tmp_path / "probe.jsonl"
        rc = probe.main(["--out", str(out), "--realistic-t", "96", "--iters", "2", "--cases", "accuracy,summary"])
    finally:
        fake_flashqla.uninstall()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 1 and {"case": "accuracy", "error": "RuntimeError: boom"}.items() <= rows[0].items(), rows[0]
    assert any(r["case"] == "summary" and r.get("how") == "flashqla_scans" for r in rows)
