"""A training session that lives in the notebook: workers started once, the model and its optimizer state kept in
them between cells, trained on, evaluated, sampled from, moved to another plan and saved on demand."""
