"""`make clean` removes what make made (.venv, .data, caches) and says it kept the load runs'
reports; `make clean-reports` removes those. Run on a copy of the Makefile in a folder of its
own, never on this checkout."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from shop.processes.servers import PROJECT_DIR as ROOT


def _make(folder: Path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", *arguments],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_make_clean_keeps_the_reports_and_says_so_and_clean_reports_removes_them(tmp_path):
    # Given a checkout with a virtualenv, embedded services' data and two batches' reports
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for made in (".venv/bin", ".data/postgres", ".pytest_cache"):
        (tmp_path / made).mkdir(parents=True)
    for batch in ("20261201-101500-ab12", "20261201-103000-cd34"):
        (tmp_path / "reports" / batch).mkdir(parents=True)
        (tmp_path / "reports" / batch / "report.html").write_text("<html></html>")

    # When it is cleaned
    cleaned = _make(tmp_path, "clean")

    # Then what make made is gone, the reports stay, and it says so and how to remove them
    assert cleaned.returncode == 0, cleaned.stderr
    assert not [name for name in (".venv", ".data", ".pytest_cache") if (tmp_path / name).exists()]
    assert len(list((tmp_path / "reports").iterdir())) == 2
    assert "kept reports/ (the load runs' reports, 2 folders): make clean-reports removes it" in (
        cleaned.stdout
    )

    # and clean-reports removes them; a clean with none left says nothing of them
    assert _make(tmp_path, "clean-reports").returncode == 0
    assert not (tmp_path / "reports").exists()
    again = _make(tmp_path, "clean")
    assert again.returncode == 0 and "reports" not in again.stdout
