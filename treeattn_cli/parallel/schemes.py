"""The merge schemes' names (docs/architecture.md §3), owned by the communication layer. No torch here: the
command line checks ``--scheme`` with them before it imports anything heavy."""

SCHEMES = ("allreduce", "allgather", "tree", "hierarchical")  # merge schemes (comm.py)
FLAT_SCHEMES = ("allreduce", "allgather", "tree")  # those a hierarchical merge's levels can use
