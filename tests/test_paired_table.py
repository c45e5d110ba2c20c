"""lab.eval.paired_table: Wilson intervals, paired counts and the marks of cells whose intervals lie apart."""

import json

import pytest

from lab.eval.intervals import wilson
from lab.eval.paired_table import cells, main, paired_rows


def test_wilson_matches_known_intervals():
    assert wilson(40, 40) == pytest.approx((0.9124, 1.0), abs=1e-4)
    assert wilson(0, 40) == pytest.approx((0.0, 0.0876), abs=1e-4)
    assert wilson(20, 40) == pytest.approx((0.3520, 0.6480), abs=1e-4)


def _write(path, rows):
    path.write_text(json.dumps({"rows": [
        {"method": m, "budget": b, "budget_tokens": t, "ratio": None, "scores": sc, "read_fraction": r}
        for m, b, t, sc, r in rows]}))
    return path


def test_rows_pair_samples_and_mark_the_side_whose_interval_is_apart(tmp_path):
    a = _write(tmp_path / "a.json", [("full", None, None, [1.0] * 40, 1.0),
                                     ("quest", 0.25, None, [1.0] * 38 + [0.0] * 2, 0.3),
                                     ("snapkv", None, 254, [0.0] * 40, 0.2)])
    b = _write(tmp_path / "b.json", [("full", None, None, [1.0] * 39 + [0.5], 1.0),
                                     ("quest", 0.25, None, [0.0] * 38 + [1.0] * 2, 0.31),
                                     ("snapkv", None, 254, [1.0] * 40, 0.2)])
    rows = paired_rows("t", cells(a), cells(b))
    assert rows[0] == "| t | full | — | 40/40 [0.91, 1.00] | 1.000 | 39.50/40 [0.89, 1.00] | 1.000 | 1 / 0 |"
    assert "| quest | 1/4 | **38/40" in rows[1] and rows[1].endswith("| 38 / 2 |")
    assert "| snapkv | 254 | *0/40" in rows[2] and rows[2].endswith("| 0 / 40 |")


def test_cells_with_other_samples_are_refused(tmp_path):
    _write(tmp_path / "a_t_4096.json", [("full", None, None, [1.0] * 40, 1.0)])
    _write(tmp_path / "b_t_4096.json", [("full", None, None, [1.0] * 39, 1.0)])
    with pytest.raises(ValueError, match="same samples"):
        main(["--a", str(tmp_path / "a_{task}_{length}.json"), "--b", str(tmp_path / "b_{task}_{length}.json"),
              "--tasks", "t", "--lengths", "4096"])
