"""The built-in skills: `arith`, `reverse`, `sort` (single turn), `calc` (multi-turn, calculator tool) and `code`
(multi-turn, the sandboxed python tool; hidden unit tests in the sandbox)."""
