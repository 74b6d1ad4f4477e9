"""Agent benchmarks: tool decisions under tool_choice="auto" (its prompt sets in data/), the cost
of the tool grammar, and prompt-lookup drafts over an agent-memory session. Results: RESULTS.md beside this file."""
