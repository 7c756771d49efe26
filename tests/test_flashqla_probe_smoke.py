"""benchmarks/flashqla_probe.py runs every case on the CPU with the flash_qla stand-in (tests/ops/fake_flashqla.py)
at tiny sizes: each row is written, a case that fails (FlashQLA's own kernels are not in the stand-in) is
a row with its error and the next case runs. The numbers themselves come from the GPU."""

from __future__ import annotations

import json

from tests.ops import fake_flashqla


def test_probe_cases_write_rows_and_survive_a_failing_case(tmp_path, monkeypatch):
    from benchmarks import flashqla_probe as probe

    monkeypatch.setattr(probe, "DEVICE", "cpu")
    monkeypatch.setattr(probe, "REALISTIC", dict(hk=2, hv=4, dk=128, dv=128))
    monkeypatch.setattr(probe, "VARLEN_LENGTHS", (40, 1, 23))
    monkeypatch.setattr(probe, "GVA_HEADS", ((2, 2), (1, 3)))
    monkeypatch.setattr(probe, "GVA_T", 64)
    fake_flashqla.install()
    try:
        out = tmp_path / "probe.jsonl"
        rc = probe.main(["--out", str(out), "--tokens", "128", "--realistic-t", "96", "--warmup", "1", "--iters", "2",
                         "--cases", "accuracy,timing,summary,varlen8,head_dims,gva,auto_cp_off,fla_dispatch"])
    finally:
        fake_flashqla.uninstall()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_case: dict = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r)
    assert rc == 0, [r for r in rows if "error" in r]
    acc = by_case["accuracy"][0]["flashqla_vs_reference"]
    assert set(acc) == {"o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"} and max(acc.values()) < 1e-2, acc
    timing = {r["variant"]: r for r in by_case["timing"] if "variant" in r}
    assert set(timing) == {"gdn_cp_flashqla", "gdn_cp_flashqla_no_auto_cp"} and timing["gdn_cp_flashqla"]["iters"] == 2
    summary = {r["how"]: r for r in by_case["summary"] if "how" in r}
    assert summary["flashqla_scans"]["M_rel_l2"] < 1e-2 and summary["flashqla_scans"]["S_ext_rel_l2"] < 1e-2, summary
    assert "error" in summary["flashqla_fused_gdr_h"]  # FlashQLA's own kernels: GPU only
    assert by_case["varlen8"][0]["sequences"] == 3 and max(by_case["varlen8"][0]["flashqla_vs_reference"].values()) < 1e-2
    dims = {r["head_dim"]: r for r in by_case["head_dims"] if "head_dim" in r}
    assert dims[64]["gdn_cp"].startswith("refuses") and "AssertionError" in dims[64]["flash_qla"] and \
        dims[128]["gdn_cp"] == "takes it", dims
    assert [r["ratio"] for r in by_case["gva"] if "ratio" in r] == [1, 3]
    assert by_case["auto_cp_off"][0]["auto_cp"] is False
    assert "skipped" in by_case["fla_dispatch"][0]
    assert by_case["all"][0]["summary"] is True
