"""The teacher store, a format: its schema (`schema.py`), codec (`codec.py`), writer (`writer.py`), reader
(`reader.py`: `TeacherTopkOutput`) and the selectors that choose which entries it keeps (`selectors/`), side by
side. The teacher-logits stage (`teacher/stage.py`) feeds it: runner -> selectors -> writer."""
