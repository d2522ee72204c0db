"""Tool calls: the functions a request offers, checked; the calls in a model's reply, read in the
format its chat template teaches; a required call enforced by a grammar in that format.

Beside lever.model.grammar, below the API and the server (which reach it through
lever.model.tool_calls). From the bottom up: `calls` (a call, read from its JSON object),
`lexing` (a call's head and its JSON's end, found as the text comes), `grammar` (a required
call's Lark, per shape), `formats` (the table of formats and their detection from a template),
`stream` (a reply's calls read as it streams, and at once), `plan` (tools and tool_choice).
"""
