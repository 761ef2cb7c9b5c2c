#pragma once
#include <unirl/recipes/token_recipe.hpp>
