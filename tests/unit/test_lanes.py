"""tests.lanes' closing block: each lane's failures and final line, short enough for a CI page's tail."""

from tests.lanes import _summary


def test_a_lane_s_summary_is_its_failures_and_its_final_line():
    lines = ["tests/a.py ....F\n", "engine servers: 2 started, 90 s until ready in all\n",
             "===== short test summary info =====\n",
             "FAILED tests/a.py::test_x - AssertionError: 1\n", "  rank 1| a server's log, printed as it stops\n",
             "ERROR tests/b.py::test_y - TimeoutError\n", "===== 1 failed, 1 error, 4 passed in 9.00s =====\n"]
    assert _summary(lines) == [lines[1], lines[3], lines[5], lines[6]]


def test_a_lane_without_a_summary_shows_its_last_line():
    assert _summary(["===== 4 passed in 9.00s =====\n"]) == ["===== 4 passed in 9.00s =====\n"]
