import pytest


def pytest_sessionfinish(session, exitstatus):
    from tests.server import Server

    left = Server.stop_leftovers()  # a server must never outlive the run, whatever failed
    if left:
        print(f"\nstopped {len(left)} server(s) a test left running: {', '.join(left)}")
    # A run that selects no tests is a broken run, never a green one.
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
