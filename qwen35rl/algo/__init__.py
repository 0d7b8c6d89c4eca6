"""GRPO math as pure tensor functions (`core`) and DAPO's extras (`dapo`); definitions in spec/grpo.md."""
