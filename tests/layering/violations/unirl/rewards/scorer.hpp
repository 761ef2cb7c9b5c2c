#pragma once
// a concept outside concepts/
template <class B>
concept HasScores = requires(const B& b) { b.scores; };
