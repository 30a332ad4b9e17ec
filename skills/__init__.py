"""What is learned: skills (task bank + environment + rubric), the plugin registry, the nano base model.

Where things are: `skill.Skill` (the unit), `taskbank` (tasks, train/eval split), `environment` (the
multi-turn loop and its failure semantics), `toolcall` (the text protocol), `tools` and `sandbox`
(tools), `rubric` (rewards), `episode` (the record), `chat` (conversations to tokens), `registry`
(`get_skill`, `list_skills`, entry-point group `skillswarm.skills`), `builtin/` (arith, calc, reverse,
sort, code) and `nano/` (tokenizer, recipe, warm-up, `build_base`). Nothing here imports `node` or `merge`.
"""
