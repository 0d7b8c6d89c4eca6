"""GRPO math as pure tensor functions (`core`) and DAPO's extras (`dapo`); definitions in spec/grpo.md. The train
engines take their loss function (`loss`) and learning-rate schedule (`lr_schedule`) from here."""
