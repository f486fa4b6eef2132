"""The ring's transport: ``ring_rewrite`` custom ops that survive compilation, and the
``Rotater`` through which the attention code uses them. By concern:

* ``ring.py``: ``Rotater`` / ``Ring``, what the attention code moves and when (Note [Ordering
  the ring's messages]);
* ``tags.py``: a transfer's ``Tag`` within its call, and its wire tag;
* ``groups.py``: the process groups the ring runs in, and their ranks (Note [Group ranks]);
* ``calls.py``: a site call's header, token and close, and a compile's agreement (Note [Calls,
  deadlines and recovery]); ``state.py``: what a rank knows of its calls in a group, and the
  layouts of tokens and headers; ``recovery.py``: collectives with deadlines, and completing
  what a failed call left;
* ``transfers.py``: ``ring_shift_start`` / ``ring_shift_wait`` (Note [Buffers in flight], Note
  [The CUDA transport]); ``waiter.py``: the transfers in flight, and the thread that waits for
  gloo's;
* ``gather.py``: ``all_gather_seq``, ``all_to_all_seq``;
* ``lowering.py``: inductor's lowering of a transfer;
* ``errors.py``: ``TransferTimeout``, ``RingOutOfStep``.

Imports among them go one way: ``errors``, ``tags``, ``groups``, ``state``, ``waiter`` <-
``recovery`` <- ``calls`` <- ``transfers`` <- ``gather``; ``ring`` and ``lowering`` need only
``tags``. Importing any of them registers every op of the transport (below).
"""

from . import calls, gather, transfers  # noqa: F401  (registers the ring_rewrite custom ops)
