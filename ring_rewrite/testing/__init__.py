"""Graph-diff testing: see, and assert in your own tests, what the rewrite did to your model.

Capture the dynamo graph before and after the ``ring_dilated`` passes (no backend to write),
diff them, and assert on the result::

    from ring_rewrite.testing import assert_expected_graph, assert_rewritten, capture

    cap = capture(model, x, segment_lengths=[64, 256], dilation_rates=[1, 4])
    diff = cap.diff()
    print(diff)               # per-site table and op counts (tabulate)
    print(diff.text)          # unified diff of the printed graphs, names normalised
    assert diff.removed_by_op == {"scaled_dot_product_attention": 2}
    assert_rewritten(cap, 2)  # fails with the report table when an upgrade stops rewriting
    assert_expected_graph(cap.after[0], "expected/block.txt")  # RING_REWRITE_ACCEPT=1 refreshes

What each piece looks at (docs/semantics.md, The rewritten graph):

* ``capture``: the dynamo graphs before and after the passes, the site records, and with
  ``aot=True`` the AOT forward / backward graphs that inductor would receive.
* ``graph_diff``: nodes removed and added (matched by graph, name and op), counts by op and by
  ``node.meta["ring_rewrite"]["role"]``, one summary row per attention site.
* ``assert_rewritten`` / ``assert_left_alone``: the site records and the graphs agree with what
  the test expects; failures show the report table.
* ``assert_same_p2p_schedule``: compiled once per rank of a fake process group, every rank issues
  the same ring transfers (op, tag, shape, dtype) in the same order, forward and backward, and
  each message has a receiver (Note [Ordering the ring's messages]);
  ``planned_transfers`` reads the same from a plan's program, without compiling.
* ``inductor_code`` / ``check_code``: the wrapper code inductor generated, and
  ``torch.testing.FileCheck`` directives run over it (where order in the code that runs matters).
* ``buffers_in_flight_violations``: in that code, every buffer a transfer sends stays alive and
  unwritten from its start to its wait, and the wait reads the buffers the start sent (Note
  [Buffers in flight]).
* ``in_block_kernel``: a fault (raise ``InjectedFault``, stall, exit) in this rank's block
  attention, between a transfer's start and its wait (``tests/test_faults.py``).
* ``assert_expected_graph``: the normalised graph text equals a stored file; with
  ``RING_REWRITE_ACCEPT=1`` in the environment the file is (re)written instead, as
  ``EXPECTTEST_ACCEPT=1`` does for torch's ``assertExpectedInline``.

The ``ring_graphs`` pytest fixture (``ring_rewrite.pytest_plugin``) hands all of these to a test.

One module per job: ``capture`` (graphs before and after the passes; AOT graphs through torch's
``AotEagerAndRecordGraphs``), ``graphs`` (stable text, op names, site bodies), ``diff``,
``schedule`` (the ring's transfers), ``asserts``, ``expected``, ``generated`` (inductor's code) and
``faults``. Every public name, with its signature: docs/api.md, Testing.
"""


from .asserts import assert_left_alone, assert_rewritten, assert_same_p2p_schedule
from .capture import Capture, capture, capture_ranks
from .diff import GraphDiff, NodeInfo, SiteSummary, graph_diff
from .expected import ACCEPT_ENV, assert_expected_graph
from .faults import InjectedFault, in_block_kernel
from .generated import buffers_in_flight_violations, check_code, inductor_code
from .graphs import graph_text, op_label, site_body
from .schedule import Transfer, planned_transfers, transfers

__all__ = [
    "ACCEPT_ENV",
    "Capture",
    "GraphDiff",
    "InjectedFault",
    "NodeInfo",
    "SiteSummary",
    "Transfer",
    "assert_expected_graph",
    "assert_left_alone",
    "assert_rewritten",
    "assert_same_p2p_schedule",
    "buffers_in_flight_violations",
    "capture",
    "capture_ranks",
    "check_code",
    "graph_diff",
    "graph_text",
    "in_block_kernel",
    "inductor_code",
    "op_label",
    "planned_transfers",
    "site_body",
    "transfers",
]
