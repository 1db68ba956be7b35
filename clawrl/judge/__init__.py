"""Judging turns: prompts (PRM score, hindsight hint), parsing, voting, judge backends, teacher
log-probs, and the per-turn pipeline that turns a judged turn into a sample and a fate."""
