"""The README's main-job command runs and prints the round-trip table."""
from fp4compile.formats import report


def test_report_runs(capsys):
    report.main(["--rows", "16", "--cols", "256", "--draws", "2"])
    out = capsys.readouterr().out
    assert "| RTN |" in out and "MS-EDEN + RHT128" in out and "MSE ratio" in out
