"""A cycle's token tree as TreeExpand grows it (stages/tree_expand.py): three parts, and the
builder that joins them behind the face the growth policies see (lever.policy.growth.Builder).

    nodes.py      the node arrays: plain state, as llama2.c keeps a forward's in its RunState
    free.py       the free sources' side: their proposals, in a heap and under tables of their own
    lookahead.py  rows drafted ahead while the target verifies, and the next tree's start from them
    builder.py    TreeBuilder: the draft model's candidates and the rounds of expansion
"""
