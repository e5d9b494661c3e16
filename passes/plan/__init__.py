"""Plan: where to cut the annotated graph into stages.

``chain`` turns the graph into a chain of nodes with the bytes each cut carries; ``partition``
solves the contiguous split exactly (``pushed`` for limits given per start), ``constraints``
and ``recompute`` say which cuts and recomputations are allowed, ``objective`` and
``step_planner`` price a split under a schedule, ``balance`` and ``orders`` search beyond one
topological order, ``refine`` re-plans from measured stage times; ``planner`` drives them.
"""
