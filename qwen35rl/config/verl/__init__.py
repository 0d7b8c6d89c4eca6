"""To and from verl: the key table, launch-script evaluation, import and export."""
