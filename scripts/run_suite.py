"""The test suite's process, as `make test` runs it: pytest, then an exit that skips Python's finalization.

The suite starts hundreds of in-process servers, clients and event loops. Their threads (gRPC's
poller, the loops' executors) are still there when the report is out, and tearing them down under
the interpreter's finalization has crashed the process (SIGSEGV) after a passing run. The status is
known once `pytest.main` returns: the process ends with it, its output flushed, and nothing after.
"""

import os
import sys

import pytest

if __name__ == "__main__":
    status = int(pytest.main(sys.argv[1:]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
