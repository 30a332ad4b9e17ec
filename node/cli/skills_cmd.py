"""`skillswarm skills ...`: list the skills this node knows (built-in and plugins) and show one."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape

from skillswarm.node.cli.common import JsonOpt, console, print_json, table
from skillswarm.skills.registry import get_skill, list_skills, origin
from skillswarm.skills.skill import Skill

app = typer.Typer(help="List and inspect skills (built-in and third-party plugins).", no_args_is_help=True)


def _summary(skill: Skill) -> dict[str, Any]:
    return {
        "name": skill.name, "version": skill.version, "description": skill.description, "origin": origin(skill.name),
        "tools": sorted(skill.env.tools), "max_turns": skill.env.max_turns, "multi_turn": not skill.env.single_turn,
    }


@app.command("list")
def list_cmd(json_out: JsonOpt = False) -> None:
    """Every skill that loads: name, version, origin, tools and turn limit."""
    rows = [_summary(s) for s in list_skills()]
    if json_out:
        print_json({"skills": rows})
        return
    console.print(table("skills", ["name", "version", "origin", "tools", "turns", "description"], [
        [r["name"], r["version"], r["origin"], ", ".join(r["tools"]) or "-", r["max_turns"], escape(r["description"])]
        for r in rows
    ]))


@app.command("show")
def show_cmd(
    name: Annotated[str, typer.Argument(help="Skill name (see `skillswarm skills list`).")],
    samples: Annotated[int, typer.Option("--samples", "-n", help="How many sample tasks to show.", min=0, max=50)] = 3,
    json_out: JsonOpt = False,
) -> None:
    """One skill: sample tasks and a reference episode, tools, limits and rubric."""
    skill = get_skill(name)
    tasks = skill.tasks.train_tasks(samples, seed=0)
    demo = skill.demonstration(tasks[0]) if tasks and skill.reference is not None else None
    tools = [{"name": t.name, "description": t.description} for t in skill.env.tools.values()]
    info = {
        **_summary(skill), "tools": tools, "system_prompt": skill.env.system_prompt,
        "max_seconds": skill.env.max_seconds, "rubric": skill.rubric.describe(),
        "samples": [{"id": t.id, "prompt": t.prompt, "answer": t.answer} for t in tasks],
        "reference_episode": [m.as_dict() for m in demo.messages] if demo else None,
    }
    if json_out:
        print_json(info)
        return
    console.print(f"[bold]{escape(skill.name)}[/] v{escape(skill.version)} ({escape(info['origin'])}): "
                  f"{escape(skill.description)}", highlight=False)
    console.print(f"turns <= {skill.env.max_turns}, wall clock <= {skill.env.max_seconds:g}s, "
                  f"system prompt: {skill.env.system_prompt!r}", highlight=False, markup=False)
    if tools:
        console.print(table("tools", ["name", "description"], [[t["name"], escape(t["description"])] for t in tools]))
    console.print(table("rubric", ["function", "weight", "kind", "per turn"], [
        [f["name"], f["weight"], f["kind"], "yes" if f["per_turn"] else "no"] for f in info["rubric"]]))
    console.print(table("sample tasks", ["id", "prompt", "answer"],
                        [[escape(t.id), escape(t.prompt), escape(t.answer)] for t in tasks]))
    if demo is not None:
        console.print(table("reference episode", ["role", "content"], [[m.role, escape(m.content)] for m in demo.messages]))
