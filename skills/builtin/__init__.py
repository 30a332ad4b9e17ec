"""The built-in skills: `arith`, `reverse`, `sort` (single turn) and `calc` (multi-turn, calculator tool)."""
